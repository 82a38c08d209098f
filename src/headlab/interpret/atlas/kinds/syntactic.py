"""syntactic: a head that attends from a word to its syntactic head or dependent (Clark et al. 2019).

Score: with a treebank (``treebank=FILE.conllu``), the head's best accuracy margin over the best
fixed-offset baseline on any relation (the probe, :func:`headlab.probe`); ``Atlas.syntactic`` lists the
relations each head is best for. Checked, on a decoder with a language-model head, on the loss on the
dependents of the top heads' relations (:mod:`headlab.interpret.atlas.dependents`).
"""

from __future__ import annotations

import math

import torch

from headlab.interpret.atlas import causal as CK
from headlab.interpret.atlas import dependents as D
from headlab.interpret.atlas.checks import sharded_gated
from headlab.interpret.atlas.kinds.base import Kind, Measure, Task, register


def _probe(loaded, treebank, limit, grid) -> tuple[dict[str, list[str]], list[str], torch.Tensor, dict[str, str]]:
    """The probe's scores: ``(relations each head is best for, notes, grid of margins, each head's relation
    of largest margin)``."""
    from headlab.interpret.probing import probe

    r = probe(loaded, treebank, limit=limit, head_map_sentences=0, grad_sentences=0, loss_model=None)
    acc = torch.as_tensor(r.accuracy - r.baseline_accuracy[:, None, None, :])  # (2, L, H, R)
    ok = torch.as_tensor(r.count >= r.min_count if hasattr(r, "min_count") else r.count > 0)
    margin = torch.where(ok[:, None, None, :] & ~torch.isnan(acc), acc, torch.tensor(-math.inf, dtype=acc.dtype))
    best = margin.amax(dim=(0, 3))
    grid[: best.shape[0], : best.shape[1]] = torch.where(torch.isinf(best), torch.nan, best).double()
    rel: dict[str, list[str]] = {}
    for b in r.best_heads:
        if b.margin > 0 and b.count >= r.min_count:
            rel.setdefault(f"{b.layer}.{b.head}", []).append(
                f"{b.relation} {b.direction} {b.accuracy:.0%} (baseline {b.baseline_accuracy:.0%})"
            )
    return (
        rel,
        [f"syntactic: {r.sentences} sentences of {r.treebank}"],
        grid,
        D.head_relations(margin, r.relation_names),
    )


def score(run):
    limit = run.sizes["treebank_limit"]
    run.say("treebank probe", 0, 1)
    rel, more, grid, best = _probe(run.loaded, run.treebank, limit, run.grid())
    run.syntactic.update(rel)
    run.notes += more
    run.state["relations"] = best  # each head's relation of largest margin: what the check gates on (kept as JSON)
    return grid


def _dependents_loss(run, result, k: int) -> Measure | str:
    best = run.state["relations"]
    relations = sorted({best[f"{l}.{h}"] for l, h in result.top("syntactic", k) if f"{l}.{h}" in best})
    found = (
        D.examples(
            run.tokenizer,
            run.treebank,
            limit=run.sizes["treebank_limit"],
            relations=relations,
            max_positions=run.loaded.max_positions,
        )
        if relations
        else []
    )
    if len(found) < 2:
        return (
            f"not run: {len(found)} treebank sentence(s) hold a dependent of the top heads' relations "
            f"({', '.join(relations) or 'none with enough cases'}) past the first token; the bootstrap "
            "needs at least 2 (give more sentences: treebank_limit)"
        )
    pad = getattr(run.tokenizer, "pad_token_id", None) or 0

    def values(configs):  # the sentences a few at a time (a language model's logits are rows x L x vocab)
        return torch.cat(
            [
                sharded_gated(
                    run.adapter,
                    {key: v.to(run.device) for key, v in inputs.items()},
                    configs,
                    CK.target_loss(targets),
                    max_rows=run.max_rows,
                )
                for inputs, targets in D.batches(found, pad_id=pad, max_rows=run.max_rows)
            ],
            1,
        )

    return Measure(
        values,
        D.task_name(relations),
        +1,
        {
            "relations": relations,
            "sentences": [e.sent_id for e in found],
            "targets": sum(len(e.targets) for e in found),
        },
    )


DEPENDENTS_LOSS = Task(
    "syntactic", "loss on the treebank words in the top heads' relations", _dependents_loss, no_lm=D.NO_LM
)

KIND = register(
    Kind(
        name="syntactic",
        role="syntactic",
        threshold=0.1,  # accuracy above the best fixed-offset baseline
        score=score,
        reads="treebank",
        task=DEPENDENTS_LOSS,
        letter="Y",
        colour="#8c564b",
        unavailable=lambda run: None if run.treebank is not None else "needs a treebank (treebank=FILE.conllu)",
        definition="best accuracy margin over the fixed-offset baseline on a treebank relation (the probe, Clark et "
        "al. 2019)",
    )
)
