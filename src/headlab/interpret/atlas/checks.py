"""The atlas's causal checks, run for every scored kind with a task (see :mod:`.causal` for the rule).

Each kind names its task (``Kind.task``, a :class:`~headlab.interpret.atlas.kinds.base.Task`); kinds that
share a task share its data and one ungated run: previous_token, duplicate_token and induction gate heads
on fresh repeated random sequences (the loss on the repeated half, from the second token of the copy on,
which an induction head can predict); sink and local on the natural-text pieces (log-perplexity, or
``1 - cos`` of the pooled embedding for a sentence encoder without a language-model head); retrieval on the
needle prompts with their answers appended (teacher-forced needle accuracy); syntactic on the treebank's
sentences (the loss on the dependents of the top heads' relations, :mod:`.dependents`; decoders with a
language-model head only). The tasks run in page order of their first kind, each one unit of the atlas
(:func:`check_task`). Every configuration of a task runs batched (:func:`.causal.gated`); under torchrun the
configurations are split over the ranks (:func:`sharded_gated`), which gives the one-process numbers; on a model sharded by tensor parallelism every
rank runs every configuration and gates the heads it holds.
"""

from __future__ import annotations

import torch

from headlab.distributed.data import all_reduce_sum
from headlab.interpret.atlas import causal as CK
from headlab.interpret.heads.ablation import config_masks


def sharded_gated(adapter, inputs, configs, metric, *, max_rows: int) -> torch.Tensor:
    """:func:`.causal.gated` with the configurations split over torchrun's ranks (every W-th from its rank)
    and the ``(C, N)`` values added back: each configuration runs on one rank, so the sum is the
    one-process result exactly. Outside torchrun, :func:`.causal.gated` itself. On a model sharded by tensor
    parallelism every rank of a tensor-parallel group runs the same configurations (each forward needs the whole
    group; the gates land on the ranks holding the heads): all of them, or its data rank's share on a 2-D mesh
    (``adapter.placement.examples``); only the group's tensor rank 0 contributes its
    values to the sum, so each configuration is still counted once."""
    place = adapter.placement
    mine = place.examples(configs.shape[0])
    n = int(inputs["input_ids"].shape[0])
    full = torch.zeros(configs.shape[0], n, dtype=torch.float64)
    if mine:
        full[mine] = CK.gated(adapter, inputs, configs[mine], metric, max_rows=max_rows)
    if place.sharded and place.tensor_rank != 0:
        full.zero_()  # the same values as the group's tensor rank 0: one copy per group goes into the sum
    return all_reduce_sum(full)


def task_groups(kinds) -> list[tuple]:
    """``[(task, [kind, ...]), ...]``: the kinds (records, page order) with a task, grouped by it, in page
    order of each task's first kind."""
    groups: dict[str, tuple] = {}
    for kd in kinds:
        if kd.task is not None:
            groups.setdefault(kd.task.name, (kd.task, []))[1].append(kd.name)
    return list(groups.values())


def check_task(result, run, task, names, *, k, n_draws, seed, n_boot) -> dict:
    """One task's causal checks (one unit of the atlas): ``{"verdicts": {kind: verdict}, "skipped": {"kind
    check": why}}`` for ``names``, the scored kinds of the task in page order; ``result`` the atlas so far (its
    scores name the top heads), ``run`` the scores' :class:`~.kinds.base.Run`."""
    adapter = run.adapter
    if task.no_lm is not None and not run.has_logits:
        return {"verdicts": {}, "skipped": {f"{kd} check": task.no_lm for kd in names}}
    measure = task.prepare(run, result, k)
    if isinstance(measure, str):  # the task's reason for not running
        return {"verdicts": {}, "skipped": {f"{kd} check": measure for kd in names}}
    sets: list[list] = [[]]
    for i, kd in enumerate(names):
        top = result.top(kd, k)
        draws = CK.draw_sets(adapter.n_layers, adapter.layer_heads, top, n_draws=n_draws, seed=seed + 101 * (i + 1))
        sets += [top] + draws
    configs = config_masks(adapter, sets)
    run.say(f"causal checks ({task.name})", 0, 1)
    vals = measure.values(configs)  # (C, N)
    run.say(f"causal checks ({task.name})", 1, 1)
    effects = measure.harm * (vals[1:] - vals[:1])  # (C - 1, N): how much worse each configuration makes each example
    verdicts = {}
    for i, kd in enumerate(names):
        rows = effects[i * (1 + n_draws) : (i + 1) * (1 + n_draws)].numpy()
        v = CK.verdict(rows[0], rows[1:], n_boot=n_boot, seed=seed)
        v.update(
            {
                "kind": kd,
                "task": measure.task,
                "k": k,
                "heads": [list(x) for x in sets[1 + i * (1 + n_draws)]],
                "draws": [[list(x) for x in s] for s in sets[2 + i * (1 + n_draws) : 1 + (i + 1) * (1 + n_draws)]],
                "baseline": float(vals[0].mean()),
                "n_examples": int(vals.shape[1]),
                "effects": {"targeted": rows[0].round(8).tolist(), "random": rows[1:].round(8).tolist()},
                "evidence": _evidence(v, k),
            }
        )
        v.update(measure.extra)
        verdicts[kd] = v
    return {"verdicts": verdicts, "skipped": {}}


def _evidence(v: dict, k: int) -> str:
    lo, hi = v["targeted_ci"]
    times = "n/a (random mean <= 0)" if v["times_random"] is None else f"{v['times_random']:.1f}x"
    return (
        f"{v['verdict']}: gating the top {k} raises the harm by {v['targeted']:.4g} [{lo:.4g}, {hi:.4g}]; "
        f"{len(v['random'])} random draws of {k}: mean {v['random_mean']:.4g}, largest upper end "
        f"{v['random_max_upper']:.4g}; {times} random"
    )


__all__ = ["check_task", "sharded_gated", "task_groups"]
