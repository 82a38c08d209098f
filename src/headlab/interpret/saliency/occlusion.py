"""Leave-one-out and token removal: how the output changes when tokens go.

    leave_one_out_t = TVD(p(x), p(x without t)),   TVD(a, b) = 0.5 * sum_c |a_c - b_c|

``p`` is the output distribution (softmax over the classes, or over the vocabulary at the last
position for a decoder); for a similarity objective, which has none, ``|y(x) - y(x without t)|``.
"Without t" is, after Jain and Wallace 2019, the input with token t deleted (``loo="delete"``);
``"mask"`` puts the tokenizer's mask token in its place and ``"unk"`` its unknown token. Special
tokens are never removed (their score is 0). All variants of one input run as one padded batch.

:func:`remove_tokens` is shared with the ERASER measures (comprehensiveness and sufficiency).
"""

from __future__ import annotations

import torch

from headlab.errors import ConfigError, ModelError
from headlab.interpret.saliency.objective import Objective

LOO_MODES = ("delete", "mask", "unk")


def tvd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total variation distance along the last axis: ``0.5 * sum |p - q|``."""
    return 0.5 * (p - q).abs().sum(-1)


def replacement_id(objective: Objective, mode: str) -> int | None:
    """The id put in a removed token's place (None for deletion)."""
    if mode not in LOO_MODES:
        raise ConfigError(f"unknown loo mode {mode!r}; known: {', '.join(LOO_MODES)}")
    if mode == "delete":
        return None
    tok = objective.loaded.tokenizer
    v = getattr(tok, f"{mode}_token_id", None) if tok is not None else None
    if v is None:
        raise ModelError(
            f"loo={mode!r} needs a {mode} token, which {objective.loaded.name}'s tokenizer does not have; "
            "use loo='delete'"
        )
    return int(v)


def remove_tokens(
    ids: list[int], removed: list[set[int]], replace: int | None, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per set in ``removed``: ``ids`` with those positions deleted (or replaced). Right-padded.

    Returns ``(input_ids (N, L'), attention_mask (N, L'))``.
    """
    rows = []
    for gone in removed:
        if replace is None:
            rows.append([t for i, t in enumerate(ids) if i not in gone])
        else:
            rows.append([replace if i in gone else t for i, t in enumerate(ids)])
    n = max(len(r) for r in rows)
    x = torch.full((len(rows), n), pad_id, dtype=torch.long)
    m = torch.zeros((len(rows), n), dtype=torch.long)
    for r, row in enumerate(rows):
        x[r, : len(row)] = torch.tensor(row, dtype=torch.long)
        m[r, : len(row)] = 1
    return x, m


def pad_id(objective: Objective) -> int:
    tok = objective.loaded.tokenizer
    v = getattr(tok, "pad_token_id", None) if tok is not None else None
    return 0 if v is None else int(v)


def output_change(
    objective: Objective,
    ref_y: torch.Tensor,
    ref_p: torch.Tensor | None,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    batch_size: int = 64,
) -> torch.Tensor:
    """``(N,)``: TVD of each row's distribution to ``ref_p`` (or ``|y - ref_y|`` without one)."""
    out = []
    dev = ref_y.device
    with torch.no_grad():
        for s in range(0, len(input_ids), batch_size):
            ids, m = input_ids[s : s + batch_size].to(dev), attention_mask[s : s + batch_size].to(dev)
            y, p = objective.y_and_probs(ids, m)
            if ref_p is None:
                out.append((y - ref_y).abs())
            else:
                assert p is not None  # the objective gave probabilities for the reference: it gives them here
                out.append(tvd(p, ref_p[None]))
    return torch.cat(out)


def leave_one_out(
    objective: Objective,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    special: list[bool],
    mode: str = "delete",
    batch_size: int = 64,
) -> torch.Tensor:
    """``(L,)`` leave-one-out scores of one input (special tokens 0); see the module docstring."""
    replace = replacement_id(objective, mode)
    with torch.no_grad():
        y0, p0 = objective.y_and_probs(input_ids, attention_mask)
    ids = input_ids[0].tolist()
    positions = [i for i, s in enumerate(special) if not s]
    scores = torch.zeros(len(ids), dtype=torch.float32, device=input_ids.device)
    if len(positions) == 0 or (replace is None and len(ids) - 1 == 0):
        return scores
    x, m = remove_tokens(ids, [{i} for i in positions], replace, pad_id(objective))
    change = output_change(objective, y0[0], None if p0 is None else p0[0], x, m, batch_size)
    scores[positions] = change.float()
    return scores
