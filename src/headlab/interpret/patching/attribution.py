"""Attribution patching (Nanda 2023; Kramar et al. 2024, "AtP"): every head's patch estimated at once.

The first-order Taylor estimate of patching activation ``a`` from the corrupted run into the clean one::

    m_patched - m_clean  ~=  (a_corrupted - a_clean) . d m / d a   (the gradient taken at the clean run)

One forward and one backward on the clean inputs give ``d m / d a`` for every site; one forward on the
corrupted inputs gives ``a_corrupted``. The dot product runs over the head's feature axis (``d`` for z,
q, k, v; the keys for a pattern row) and over positions (all at once, or per position with
``positions``); ``m`` is the metric's mean over examples. Effects are normalised as exact patching's
(:mod:`.result`), so the two grids compare entry by entry (:func:`~.result.compare`).

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


def attribution_patch(model, clean, corrupted, metric, *, sites: str | list[str] = "z", positions=None,
                      backend: str | None = None) -> PatchResult:
    """Attribution patching of every head (and position) in one forward + backward on the clean run.

    Arguments as :func:`~headlab.interpret.patching.exact.patch` (no ``max_rows``: the clean batch runs
    once with gradients). Returns a :class:`PatchResult` with ``method="attribution"``; ``raw`` is the
    estimated ``m_patched - m_clean``.
    """
    t0 = time.perf_counter()
    pair = runs.prepare(model, clean, corrupted)
    kinds = runs.check_kinds(sites, runs.HEAD_KINDS)
    pos = runs.check_positions(positions, pair.length)
    a = pair.adapter
    names = [a.site_name(l, k) for l in range(a.n_layers) for k in kinds]

    def scalar(outputs):
        return evaluate(metric, logits_of(outputs), pair.n).mean()

    grad_cache = capture(a, pair.clean, names, grads=True, scalar=scalar, backend=backend)
    m_clean = float(grad_cache.scalar)
    corrupt_cache = capture(a, pair.corrupted, names, backend=backend)
    with torch.no_grad():
        m_corrupt = float(evaluate(metric, logits_of(corrupt_cache.outputs), pair.n).mean())
    runs.check_gap(m_clean, m_corrupt)  # no gap: every effect would be 0/0
    raw = {}
    for kind in kinds:
        grids = []
        for l in range(a.n_layers):
            name = a.site_name(l, kind)
            delta = (corrupt_cache[name] - grad_cache[name]).double()  # (B, heads, L, feature)
            g = grad_cache.grads[name].double()
            per_pos = (delta * g).sum(-1).sum(0)  # (heads, L): over the feature axis and the examples
            grids.append(per_pos.sum(-1) if pos is None else per_pos[:, pos])
        width = max(t.shape[0] for t in grids)
        grid = torch.full((a.n_layers, width, *grids[0].shape[1:]), float("nan"), dtype=torch.float64)
        for l, t in enumerate(grids):
            grid[l, :t.shape[0]] = t
        raw[kind] = grid.float()
    notes = ["first-order estimate (gradient at the clean run times the corrupted-minus-clean activation); "
             "compare with exact patching before trusting a ranking"]
    return PatchResult(model=pair.model_name, method="attribution", metric=getattr(metric, "__name__", "metric"),
                       n_examples=pair.n, clean=m_clean, corrupted=m_corrupt,
                       effects={k: normalise(v, m_clean, m_corrupt) for k, v in raw.items()}, raw=raw,
                       positions=pos, seconds=time.perf_counter() - t0, notes=notes)


__all__ = ["attribution_patch"]
