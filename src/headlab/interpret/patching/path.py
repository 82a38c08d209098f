"""Path patching (Wang et al. 2022): the effect of a sender head along its path into chosen receivers.

For each sender head ``s`` (configurations stacked, as in :func:`~.exact.patch`):

1. *Sender run*: the clean inputs, with ``z_s`` taken from the corrupted run and the output z of every
   other head, in every layer, frozen at its clean value. The change of ``s`` thus reaches later layers
   only through the residual stream (and the MLPs, which recompute: they are not heads). The receivers'
   inputs (their ``q``, ``k`` or ``v`` as the scores see them) are recorded.
2. *Receiver run*: the clean inputs, with only the receivers' recorded ``q``/``k``/``v`` put in; nothing
   else is touched, and the metric is read.

With ``receivers=None`` the path ends at the logits: the metric is read from the sender run itself (the
sender's direct effect, plus what the MLPs make of it, with every other head frozen), as Wang et al.
use for the name movers. Effects are normalised as exact patching's (:mod:`.result`). Heads in or after
the last receiver's layer cannot reach a receiver and are not measured (NaN). On a model sharded by tensor
parallelism (every rank calling ``path_patch`` alike) the recordings are gathered in global head order and
every freeze and put-in is made per head on the rank that holds it; the result equals one process's.

::

    sender s (corrupted) --residual--> [all other heads frozen at clean] --> receiver r.q  --> ... metric
                                                                               (only this input changes)
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from headlab.errors import ConfigError
from headlab.interpret.patching import runs
from headlab.interpret.patching.result import PatchResult, normalise
from headlab.models.tensor_parallel import by_heads
from headlab.progress import Progress, reporter

RECEIVER_INPUTS = ("q", "k", "v")


def _heads(items, adapter, what: str) -> list[tuple[int, int]]:
    out = []
    for item in items:
        try:
            l, h = (int(x) for x in item)
        except (TypeError, ValueError):
            raise ConfigError(f"{what} must be (layer, head) pairs, got {item!r}") from None
        if not 0 <= l < adapter.n_layers or not 0 <= h < adapter.layer_heads[l]:
            raise ConfigError(
                f"{what} head ({l}, {h}) is out of range: {adapter.n_layers} layers of {adapter.n_heads} heads"
            )
        out.append((l, h))
    if not out:
        raise ConfigError(f"{what} is empty; give (layer, head) pairs")
    return out


def path_patch(
    model,
    clean,
    corrupted,
    metric,
    *,
    receivers: Sequence[tuple[int, int]] | None = None,
    receiver_input: str | Sequence[str] = "q",
    senders: Sequence[tuple[int, int]] | None = None,
    max_rows: int = 256,
    backend: str | None = None,
    progress: bool | Progress = False,
) -> PatchResult:
    """Path patching from each sender head into the receivers' ``receiver_input`` (or the logits).

    Args:
        model, clean, corrupted, metric: as :func:`~headlab.interpret.patching.exact.patch`.
        receivers: ``[(layer, head), ...]``; None: the path ends at the logits.
        receiver_input: ``"q"``, ``"k"``, ``"v"`` or several of them (each receiver gets all listed). For
            k and v a receiver's kv head (``h // (H // Hkv)``) is patched.
        senders: ``[(layer, head), ...]``; default every head of every layer before the last receiver's
            (every head, with ``receivers=None``).
        max_rows: rows per forward (senders stacked times B examples).
        progress: a bar (True), nothing (False) or ``progress(stage, done, total)`` (:mod:`headlab.progress`).
            Interrupted (Ctrl-C), the result keeps what was measured.

    Returns:
        :class:`PatchResult` with ``method="path"`` and a ``(n_layers, H)`` grid ``effects["z"]``.
    """
    t0 = time.perf_counter()
    pair = runs.prepare(model, clean, corrupted)
    a = pair.adapter
    inputs = [receiver_input] if isinstance(receiver_input, str) else list(receiver_input)
    if not inputs or any(k not in RECEIVER_INPUTS for k in inputs):
        raise ConfigError(f"receiver_input={receiver_input!r}: choose from {', '.join(RECEIVER_INPUTS)}")
    recv = None if receivers is None else _heads(receivers, a, "receivers")
    last = a.n_layers if recv is None else max(l for l, _ in recv)
    send = (
        [(l, h) for l in range(last) for h in range(a.layer_heads[l])]
        if senders is None
        else [s for s in _heads(senders, a, "senders") if s[0] < last]
    )
    if not send:
        raise ConfigError(
            f"no sender lies before the last receiver's layer {last}: a head reaches a receiver only "
            "from an earlier layer"
        )
    z_names = [a.site_name(l, "z") for l in range(a.n_layers)]
    clean_vals, clean_cache = runs.run_metric(pair, metric, pair.clean, 1, sites=z_names, backend=backend)
    corrupt_vals, corrupt_cache = runs.run_metric(pair, metric, pair.corrupted, 1, sites=z_names, backend=backend)
    m_clean, m_corrupt = float(clean_vals.mean()), float(corrupt_vals.mean())
    runs.check_gap(m_clean, m_corrupt)  # before the patched runs: no gap, every effect 0/0
    group = a.n_heads // a.n_kv_heads
    recv_sites: dict[str, list[int]] = {}  # site name -> heads of that site to put in
    for l, h in recv or []:
        for kind in inputs:
            recv_sites.setdefault(a.site_name(l, kind), []).append(h if kind == "q" else h // group)
    raw = torch.full((a.n_layers, a.n_heads), float("nan"))
    done = 0
    try:
        with reporter(progress) as say:
            say("path patching", 0, len(send))
            for chunk in runs.chunks(send, runs.copies_per_forward(pair.n, max_rows)):
                vals = _sender_chunk(pair, metric, chunk, clean_cache, corrupt_cache, recv_sites, recv is None, backend)
                for i, (l, h) in enumerate(chunk):
                    raw[l, h] = float(vals[i].mean()) - m_clean
                done += len(chunk)
                say("path patching", done, len(send))
    except KeyboardInterrupt:  # keep what was measured
        pass
    notes = ["every non-sender head's output z is frozen at its clean value in the sender run; MLPs recompute"]
    if done < len(send):
        notes.append(f"interrupted after {done} of {len(send)} senders; the others are NaN")
    if recv is not None and any(k in inputs for k in ("k", "v")) and group > 1:
        notes.append(f"k and v of a receiver are its kv head's, shared by {group} query heads")
    return PatchResult(
        model=pair.model_name,
        method="path",
        metric=getattr(metric, "__name__", "metric"),
        n_examples=pair.n,
        clean=m_clean,
        corrupted=m_corrupt,
        effects={"z": normalise(raw, m_clean, m_corrupt)},
        raw={"z": raw},
        receivers={
            "heads": None if recv is None else [list(r) for r in recv],
            "input": "logits" if recv is None else inputs,
        },
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


def _sender_chunk(pair, metric, chunk, clean_cache, corrupt_cache, recv_sites, to_logits: bool, backend):
    """``(C, B)`` metric values for ``C`` senders: the sender run, then (with receivers) the receiver run."""
    a, C = pair.adapter, len(chunk)
    freeze = {}
    for l in range(a.n_layers):
        name = a.site_name(l, "z")
        c_z, k_z = clean_cache[name], corrupt_cache[name]  # (B, H, L, d)
        mask = torch.zeros(C, c_z.shape[1], pair.length, dtype=torch.bool)  # (C, H, L): the sender
        for i, (sl, sh) in enumerate(chunk):
            if sl == l:
                mask[i, sh] = True
        freeze[name] = _frozen(mask, pair.n, k_z, c_z)
    vals, cache = runs.run_metric(pair, metric, pair.clean, C, edits=freeze, sites=list(recv_sites), backend=backend)
    if to_logits:
        return vals
    put = {}
    for name, heads in recv_sites.items():
        got = cache[name]  # (C * B, heads, L, d): what each receiver saw in the sender run
        mask = torch.zeros(C, got.shape[1], pair.length, dtype=torch.bool)
        mask[:, heads] = True
        put[name] = _stacked(mask, got)
    vals, _ = runs.run_metric(pair, metric, pair.clean, C, edits=put, backend=backend)
    return vals


def _frozen(mask: torch.Tensor, n: int, corrupt: torch.Tensor, clean: torch.Tensor):
    """z of copy c := corrupted where ``mask[c]`` (the sender), clean everywhere else (the model's own z unused).
    Made per head (:class:`by_heads`): on a sharded model each rank writes the heads it holds."""

    def edit(t: torch.Tensor, site: str, heads: range) -> torch.Tensor:
        C, hs = mask.shape[0], slice(heads.start, heads.stop)
        m = mask[:, hs].to(t.device).view(C, 1, len(heads), mask.shape[2], 1)  # (C, 1, heads, L, 1)
        out = torch.where(m, corrupt[:, hs].to(t).unsqueeze(0), clean[:, hs].to(t).unsqueeze(0))  # (C, B, heads, L, d)
        return out.reshape(t.shape)

    return by_heads(edit)


def _stacked(mask: torch.Tensor, source: torch.Tensor):
    """Copy c's rows of ``source (C * B, heads, L, d)`` put in where ``mask[c]`` is True (per head, as
    :func:`_frozen`)."""

    def edit(t: torch.Tensor, site: str, heads: range) -> torch.Tensor:
        C, hs = mask.shape[0], slice(heads.start, heads.stop)
        m = mask[:, hs].to(t.device).view(C, 1, len(heads), mask.shape[2], 1)
        src = source[:, hs].to(t).reshape(C, -1, *t.shape[1:])
        return torch.where(m, src, t.view(C, -1, *t.shape[1:])).reshape(t.shape)

    return by_heads(edit)


__all__ = ["RECEIVER_INPUTS", "path_patch"]
