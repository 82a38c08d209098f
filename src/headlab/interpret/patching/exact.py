"""Exact activation patching: :func:`patch`, one head (and position) at a time, configurations stacked.

For every head ``h`` of every layer ``l`` (and, with ``positions``, every chosen position ``i``), the
clean run is repeated with one activation replaced by its value in the corrupted run::

    z[l][b, h, i, :] := z_corrupted[l][b, h, i, :]        (site "z": the head's output, before W^O)

and the metric's mean over examples is compared with the clean run's (the effect, normalised as in
:mod:`.result`). Sites ``q``, ``k``, ``v`` (k and v per kv head: in a GQA model patching one kv head
changes what every query head of its group reads) and ``pattern`` (the query row ``i`` of head h's map)
are patched the same way; everything downstream is recomputed. ``C`` configurations share one forward
of ``C * B`` rows (``max_rows``). On a model sharded by tensor parallelism (every rank calling ``patch``
alike) each head is patched on the rank that holds it, and the result equals one process's.

:func:`patch` runs through the study runner as the ``patch`` instrument (its checks, its unit, progress and
torchrun); :func:`sweep` is the work of one unit.
"""

from __future__ import annotations

import time

import torch

from headlab.interpret.patching import runs
from headlab.interpret.patching.result import PatchResult, normalise
from headlab.models.tensor_parallel import by_heads
from headlab.progress import Progress, reporter


def patch(
    model,
    clean,
    corrupted,
    metric,
    *,
    sites: str | list[str] = "z",
    positions=None,
    layers=None,
    max_rows: int = 256,
    backend: str | None = None,
    progress: bool | Progress = False,
) -> PatchResult:
    """The effect of patching each head's activation from the corrupted run into the clean one.

    Args:
        model: a LoadedModel, an ``nn.Module`` of a supported family, or an adapter.
        clean, corrupted: text (with a LoadedModel), ``input_ids (B, L)`` or dicts with ``input_ids`` and
            ``attention_mask``; both of the same shape and padding (position i is patched by position i).
        metric: ``metric(logits (B, L, V)) -> (B,)``, e.g. :func:`~headlab.interpret.patching.metrics.logit_diff`.
        sites: ``"z"`` (default) or any of ``"z", "q", "k", "v", "pattern"`` (per head) and ``"resid_pre"``,
            ``"resid_post"``, ``"mlp_out"`` (per layer: their grids have one column).
        positions: None (each head at every position at once), ``"each"`` (every position separately) or a
            list of positions patched one at a time; grids then gain a last axis of that length.
        layers: the layers to patch (default all).
        max_rows: rows per forward (``configurations * B``).
        backend: the attention backend of every run (default: the adapter's, else ``"auto"``).
        progress: a bar (True), nothing (False) or ``progress(stage, done, total)`` (:mod:`headlab.progress`).
            Interrupted (Ctrl-C) during the patched runs, the result keeps what was measured.

    The ``patch`` instrument runs it (the study runner's :func:`~headlab.interpret.study.runner.call`): the
    checks before any run, then one unit, the :func:`sweep` over every kind asked for (its configurations stacked
    across kinds, as one call always measured them). Under torchrun every rank returns the whole result; on a
    model sharded by tensor parallelism (every rank calling ``patch`` alike) each head is patched on the rank
    that holds it.

    Returns:
        :class:`~headlab.interpret.patching.result.PatchResult` (``method="exact"``).

        >>> import torch, headlab
        >>> from headlab.models.transformer import Transformer, TransformerConfig
        >>> from headlab.interpret.patching import logit_diff
        >>> _ = torch.manual_seed(0); m = Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=2,
        ...     n_heads=2, causal=True)).eval()
        >>> clean, corrupt = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
        >>> r = headlab.patch(m, clean, corrupt, logit_diff(2, 5))
        >>> r.effects["z"].shape
        torch.Size([2, 2])
    """
    from headlab.interpret.study import runner

    options = {
        "model": model,
        # the command's four texts give way to the inputs as they are (texts, ids or dicts) and their metric
        **dict.fromkeys(("clean", "corrupted", "answer", "wrong")),
        "inputs": (clean, corrupted),
        "metric": metric,
        "sites": sites,
        "positions": positions,
        "layers": layers,
        "max_rows": max_rows,
        "backend": backend,
    }
    return runner.call("patch", options, progress=progress).results["exact"]


def sweep(
    model,
    clean,
    corrupted,
    metric,
    *,
    sites: str | list[str] = "z",
    positions=None,
    layers=None,
    max_rows: int = 256,
    backend: str | None = None,
    progress: bool | Progress = False,
) -> PatchResult:
    """One exact sweep: :func:`patch`'s work (the arguments are its), run by the ``patch`` instrument's units.

    Every configuration (kind, layer, head and position) of ``sites`` is measured, ``max_rows`` rows per forward;
    interrupted (Ctrl-C) during the patched runs, the measured configurations are kept, the others NaN, and the
    notes say so."""
    t0 = time.perf_counter()
    pair = runs.prepare(model, clean, corrupted)
    kinds = runs.check_kinds(sites)
    pos = runs.check_positions(positions, pair.length)
    a = pair.adapter
    chosen_layers = list(range(a.n_layers)) if layers is None else [a._check_layer(int(l)) for l in layers]
    names = [a.site_name(l, k) for l in chosen_layers for k in kinds]
    clean_vals, _ = runs.run_metric(pair, metric, pair.clean, 1, backend=backend)
    corrupt_vals, corrupt_cache = runs.run_metric(pair, metric, pair.corrupted, 1, sites=names, backend=backend)
    m_clean, m_corrupt = float(clean_vals.mean()), float(corrupt_vals.mean())
    runs.check_gap(m_clean, m_corrupt)  # before the patched runs: no gap, every effect 0/0
    per_forward = runs.copies_per_forward(pair.n, max_rows)
    P = 1 if pos is None else len(pos)
    configs = [
        (kind, l, h, p)
        for kind in kinds
        for l in chosen_layers
        for h in range(runs.n_heads(kind, corrupt_cache[a.site_name(l, kind)]))
        for p in range(P)
    ]
    width = {k: max(runs.n_heads(k, corrupt_cache[a.site_name(l, k)]) for l in chosen_layers) for k in kinds}
    raw = {k: torch.full((a.n_layers, width[k], *(() if pos is None else (P,))), float("nan")) for k in kinds}
    done = 0
    try:
        with reporter(progress) as say:
            say("patching", 0, len(configs))
            for chunk in runs.chunks(configs, per_forward):
                edits = {}
                for kind in {c[0] for c in chunk}:
                    for l in {c[1] for c in chunk if c[0] == kind}:
                        name = a.site_name(l, kind)
                        src = corrupt_cache[name]  # (B, heads, L, ...), or (B, L, E) for a residual site
                        mask = torch.zeros(
                            len(chunk), runs.n_heads(kind, src), pair.length, dtype=torch.bool
                        )  # (C, heads, L)
                        for i, (k2, l2, h, p) in enumerate(chunk):
                            if (k2, l2) == (kind, l):
                                if pos is None:
                                    mask[i, h, :] = True
                                else:
                                    mask[i, h, pos[p]] = True
                        edits[name] = _on_owners(kind, mask, pair.n, src)
                vals, _ = runs.run_metric(pair, metric, pair.clean, len(chunk), edits=edits, backend=backend)
                for i, (kind, l, h, p) in enumerate(chunk):
                    idx = (l, h) if pos is None else (l, h, p)
                    raw[kind][idx] = float(vals[i].mean()) - m_clean
                done += len(chunk)
                say("patching", done, len(configs))
    except KeyboardInterrupt:  # keep what was measured: the rest stays NaN, and the notes say so
        pass
    notes = (
        []
        if done == len(configs)
        else [f"interrupted after {done} of {len(configs)} configurations; the others are NaN"]
    )
    if any(k in kinds for k in ("k", "v")) and a.n_kv_heads != a.n_heads:
        notes.append(
            f"k and v are patched per kv head ({a.n_kv_heads} of them); each is read by "
            f"{a.n_heads // a.n_kv_heads} query heads"
        )
    return PatchResult(
        model=pair.model_name,
        method="exact",
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


def _on_owners(kind: str, mask: torch.Tensor, n: int, source: torch.Tensor):
    """The patch of one site (:func:`~headlab.interpret.patching.runs.patch_edit`), made per head: on a model
    sharded by tensor parallelism each rank patches the heads it holds, from its slice of the (gathered) corrupted
    source and of the mask, and nothing else moves between ranks. A residual site (no head axis) is patched as it
    is on every rank."""
    if kind in runs.RESID_KINDS:
        return runs.patch_edit(kind, mask, n, source)
    return by_heads(
        lambda t, site, heads: runs.where_heads(
            mask[:, heads.start : heads.stop], n, source[:, heads.start : heads.stop]
        )(t, site)
    )


__all__ = ["patch", "sweep"]
