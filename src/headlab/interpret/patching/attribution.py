"""Attribution patching (Nanda 2023; Kramar et al. 2024, "AtP"): every head's patch estimated at once.

The first-order Taylor estimate of patching activation ``a`` from the corrupted run into the clean one::

    m_patched - m_clean  ~=  (a_corrupted - a_clean) . d m / d a   (the gradient taken at the clean run)

One forward and one backward on the clean inputs give ``d m / d a`` for every site; one forward on the
corrupted inputs gives ``a_corrupted``. The dot product runs over the head's feature axis (``d`` for z,
q, k, v; the keys for a pattern row) and over positions (all at once, or per position with
``positions``); ``m`` is the metric's mean over examples. Effects are normalised as exact patching's
(:mod:`.result`), so the two grids compare entry by entry (:func:`~.result.compare`). On a model sharded
by tensor parallelism each rank takes the gradients of its own heads (:mod:`headlab.models.tp_grads` says why
the sharded backward gives them whole) and the grids are added over the group.

Where it fails (Kramar et al.): a saturated softmax has a near-zero gradient although a large change
of its input moves it (attention saturation), and contributions of opposite sign cancel within a
head; compare with exact patching on a subset before trusting a ranking.
"""

from __future__ import annotations

import time

import torch

from headlab.interpret.capture import capture
from headlab.interpret.patching import runs
from headlab.interpret.patching.metrics import evaluate, logits_of
from headlab.interpret.patching.result import PatchResult, normalise
from headlab.models.tp_grads import site_grads


def attribution_patch(
    model, clean, corrupted, metric, *, sites: str | list[str] = "z", positions=None, backend: str | None = None
) -> PatchResult:
    """Attribution patching of every head (and position) in one forward + backward on the clean run.

    Arguments as :func:`~headlab.interpret.patching.exact.patch` (no ``max_rows``: the clean batch runs
    once with gradients). Returns a :class:`PatchResult` with ``method="attribution"``; ``raw`` is the
    estimated ``m_patched - m_clean``. On a model sharded by tensor parallelism (every rank calling it alike)
    each rank takes the gradients of the heads it holds (:func:`~headlab.models.tp_grads.site_grads`), makes
    their sums and adds the grids over the group: the result equals one process's, on every rank.
    """
    t0 = time.perf_counter()
    pair = runs.prepare(model, clean, corrupted)
    kinds = runs.check_kinds(sites, runs.HEAD_KINDS)
    pos = runs.check_positions(positions, pair.length)
    a = pair.adapter
    names = [a.site_name(l, k) for l in range(a.n_layers) for k in kinds]

    def scalar(outputs):
        return evaluate(metric, logits_of(outputs), pair.n).mean()

    if a.placement.sharded:  # sharded by tensor parallelism: each rank its own heads, added over the group
        raw, m_clean, m_corrupt = _sharded(a, pair, names, kinds, pos, scalar, metric, backend)
    else:
        raw, m_clean, m_corrupt = _one_process(a, pair, names, kinds, pos, scalar, metric, backend)
    notes = [
        "first-order estimate (gradient at the clean run times the corrupted-minus-clean activation); "
        "compare with exact patching before trusting a ranking"
    ]
    return PatchResult(
        model=pair.model_name,
        method="attribution",
        metric=getattr(metric, "__name__", "metric"),
        n_examples=pair.n,
        clean=m_clean,
        corrupted=m_corrupt,
        effects={k: normalise(v, m_clean, m_corrupt) for k, v in raw.items()},
        raw=raw,
        positions=pos,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


def _grid(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """``(n_layers, width, ...)`` float64, NaN where a (pruned) layer has fewer heads than ``width``."""
    grid = torch.full((len(parts), width, *parts[0].shape[1:]), float("nan"), dtype=torch.float64)
    for l, t in enumerate(parts):
        grid[l, : t.shape[0]] = t
    return grid


def _per_head(delta: torch.Tensor, g: torch.Tensor, pos) -> torch.Tensor:
    """``(heads,)`` or ``(heads, P)``: ``delta . g`` over the feature axis, the examples and the positions (all
    of them, or each of ``pos``); both ``(B, heads, L, feature)``."""
    per_pos = (delta.double() * g.double()).sum(-1).sum(0)  # (heads, L)
    return per_pos.sum(-1) if pos is None else per_pos[:, pos]


def _one_process(a, pair, names, kinds, pos, scalar, metric, backend):
    grad_cache = capture(a, pair.clean, names, grads=True, scalar=scalar, backend=backend)
    m_clean = float(grad_cache.scalar)
    corrupt_cache = capture(a, pair.corrupted, names, backend=backend)
    with torch.no_grad():
        m_corrupt = float(evaluate(metric, logits_of(corrupt_cache.outputs), pair.n).mean())
    runs.check_gap(m_clean, m_corrupt)  # no gap: every effect would be 0/0
    raw = {}
    for kind in kinds:
        grids = [
            _per_head(
                corrupt_cache[a.site_name(l, kind)] - grad_cache[a.site_name(l, kind)],
                grad_cache.grads[a.site_name(l, kind)],
                pos,
            )
            for l in range(a.n_layers)
        ]
        raw[kind] = _grid(grids, max(t.shape[0] for t in grids)).float()
    return raw, m_clean, m_corrupt


def _sharded(a, pair, names, kinds, pos, scalar, metric, backend):
    """Attribution on a model sharded by tensor parallelism: the clean gradients and the corrupted activations
    of this rank's heads (nothing gathered), each head's sum made on its owner, the grids added over the group
    (every other rank holds zeros there, so the sum is the owner's number exactly)."""
    sg = site_grads(a, pair.clean, {n: n.rsplit(".", 1)[-1] for n in names}, scalar, backend=backend)
    corrupt_cache = capture(a, pair.corrupted, names, backend=backend, gather="none")
    with torch.no_grad():
        m_corrupt = float(evaluate(metric, logits_of(corrupt_cache.outputs), pair.n).mean())
    runs.check_gap(sg.scalar, m_corrupt)
    raw = {}
    for kind in kinds:
        width = a.n_kv_heads if kind in ("k", "v") else a.n_heads
        grid = torch.zeros(a.n_layers, width, *(() if pos is None else (len(pos),)), dtype=torch.float64)
        for l in range(a.n_layers):
            name = a.site_name(l, kind)
            heads = sg.heads[name]
            grid[l, heads.start : heads.stop] = _per_head(corrupt_cache[name] - sg.values[name], sg.grads[name], pos)
        raw[kind] = a.placement.sum_group(grid).float()  # each head from its owner, zeros elsewhere
    return raw, sg.scalar, m_corrupt


__all__ = ["attribution_patch"]
