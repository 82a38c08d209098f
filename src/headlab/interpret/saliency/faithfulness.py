"""ERASER faithfulness (DeYoung et al. 2020): does removing what a method ranks first change the prediction?

For one input, the explained class y, a method's ranking of the non-special tokens (highest score
first; signed scores, so "supports y" comes first), and a share k of the tokens:

    comprehensiveness_k = p(y | x) - p(y | x without its top-k% tokens)       (higher = more faithful)
    sufficiency_k       = p(y | x) - p(y | only its top-k% tokens)             (lower = more faithful)
    AOPC                = mean over k in (1, 5, 10, 20, 50)% of the above    (area over the perturbation curve)

Top-k% is ``ceil(k/100 * n)`` of the n non-special tokens; special tokens always stay; removal
deletes the tokens (as leave-one-out does). For a similarity objective ``y`` itself replaces
``p(y | .)``. A ``"random"`` ranking (seeded) is measured alongside as the floor a method must beat.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from headlab.interpret.saliency.objective import Objective
from headlab.interpret.saliency.occlusion import pad_id, remove_tokens

REPORT_BINS = (10, 20, 50)  # the shares reported one by one
AOPC_BINS = (1, 5, 10, 20, 50)  # ERASER's bins for the area over the perturbation curve


@dataclass
class Faithfulness:
    """One method on one input: ``comprehensiveness[k]`` and ``sufficiency[k]`` for k in AOPC_BINS, and AOPCs."""

    method: str
    comprehensiveness: dict[int, float]
    sufficiency: dict[int, float]

    @property
    def aopc_comprehensiveness(self) -> float:
        return sum(self.comprehensiveness[k] for k in AOPC_BINS) / len(AOPC_BINS)

    @property
    def aopc_sufficiency(self) -> float:
        return sum(self.sufficiency[k] for k in AOPC_BINS) / len(AOPC_BINS)

    def to_json(self) -> dict:
        return {
            "comprehensiveness": {str(k): v for k, v in self.comprehensiveness.items()},
            "sufficiency": {str(k): v for k, v in self.sufficiency.items()},
            "aopc_comprehensiveness": self.aopc_comprehensiveness,
            "aopc_sufficiency": self.aopc_sufficiency,
        }


def top_k(ranking: list[int], n: int, k: int) -> list[int]:
    """The first ``ceil(k/100 * n)`` positions of ``ranking`` (at least one)."""
    return ranking[: max(1, math.ceil(k / 100 * n))]


def eraser(
    objective: Objective,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    special: list[bool],
    scores: dict[str, list[float]],
    *,
    seed: int = 0,
    random_baseline: bool = True,
    batch_size: int = 64,
) -> dict[str, Faithfulness]:
    """ERASER measures for every method in ``scores`` (and ``"random"``) on one input, all in one padded batch."""
    ids = input_ids[0].tolist()
    keep = [i for i, s in enumerate(special) if not s]
    n = len(keep)
    rankings = {m: sorted(keep, key=lambda i, s=s: -s[i]) for m, s in scores.items()}  # type: ignore[misc]  # mypy cannot type a lambda's default-bound argument
    if random_baseline:
        order = list(keep)
        random.Random(seed).shuffle(order)
        rankings["random"] = order
    removed, index = [], []
    for m, r in rankings.items():
        for k in AOPC_BINS:
            top = set(top_k(r, n, k))
            removed.append(top)  # comprehensiveness: delete the top tokens
            removed.append(set(keep) - top)  # sufficiency: delete everything else
            index.append((m, k))
    x, mask = remove_tokens(ids, removed, None, pad_id(objective))
    with torch.no_grad():
        y0, p0 = objective.y_and_probs(input_ids, attention_mask)
        vals = []
        for s in range(0, len(x), batch_size):
            y, p = objective.y_and_probs(
                x[s : s + batch_size].to(input_ids.device), mask[s : s + batch_size].to(input_ids.device)
            )
            vals.append(y if p is None else p[:, objective.target])
    ref = float(y0[0]) if p0 is None else float(p0[0, objective.target])
    v = torch.cat(vals).tolist()
    out = {m: Faithfulness(m, {}, {}) for m in rankings}
    for j, (m, k) in enumerate(index):
        out[m].comprehensiveness[k] = ref - v[2 * j]
        out[m].sufficiency[k] = ref - v[2 * j + 1]
    return out
