"""Exact edge patching: single edges (:func:`edge_patch`) and whole edge sets (:func:`patched_metric`).

**One edge** ``s -> r``: the clean run, with ``delta_s = out_s(corrupted) - out_s(clean)`` added to receiver
``r``'s input only; everything downstream recomputes. Two stacked forwards measure ``C`` edges (one copy of
the ``B`` clean examples per edge, ``max_rows`` rows in all):

1. each copy adds its ``delta_s`` where its receiver reads the stream (the block's input for q, k, v and a
   parallel MLP; the attention's output for a sequential MLP) and the receiver's own value is recorded there
   (its q, k or v head, or the MLP's output);
2. the clean copies run again with only that value put in (one head, one kv head or the MLP); the metric is read.
   A logits receiver needs one forward: the final stream plus ``delta_s``.

**A set of edges** (everything outside a circuit, say): every receiver reads its own stream, ``x - sum over its
patched edges (out_s - ablated_s)``, with ``out_s`` what the sender writes *in this run*. One forward of
``K = 1 + H + 2 Hkv + 1`` copies per example does it: at every block the copies are rebuilt from the main
stream (copy 0) with each receiver's correction, each head's q (k, v) is taken from its own copy, the MLP's
output from the MLP's copy, and the main stream carries on (:func:`~headlab.models.fanout.fan_out`). The
ablated value is the corrupted run's (``"patch"``), the mean over the corrupted examples (``"mean"``), another
pair's corrupted run (``"resample"``) or zero (``"zero"``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from headlab.errors import ConfigError
from headlab.interpret.circuits import nodes
from headlab.interpret.circuits.graph import Graph
from headlab.interpret.circuits.graph import graph as build_graph
from headlab.interpret.circuits.result import EdgeScores
from headlab.interpret.patching import runs
from headlab.interpret.patching.metrics import evaluate, logits_of
from headlab.models.fanout import blocks, fan_out
from headlab.progress import Progress, reporter

ABLATIONS = ("patch", "mean", "resample", "zero")


def _setup(model, clean, corrupted, metric, backend):
    pair = runs.prepare(model, clean, corrupted)
    g = build_graph(pair.adapter)
    with torch.no_grad():
        clean_out, clean_run = nodes.record(pair, g, pair.clean, backend)
        corrupt_out, corrupt_run = nodes.record(pair, g, pair.corrupted, backend)
        m_clean = float(evaluate(metric, logits_of(clean_run), pair.n).mean())
        m_corrupt = float(evaluate(metric, logits_of(corrupt_run), pair.n).mean())
    return pair, g, clean_out, corrupt_out, m_clean, m_corrupt


def _edge_list(g: Graph, edges) -> list[int]:
    if edges is None:
        return list(range(g.n_edges))
    if isinstance(edges, str):
        edges = [edges]
    out = [g.edge_index(e) for e in edges]
    if not out:
        raise ConfigError("edges is empty; give edge names such as 'a0.h1->a1.h0<q>', or None for every edge")
    return out


def edge_patch(
    model,
    clean,
    corrupted,
    metric,
    edges: Iterable[str] | None = None,
    *,
    max_rows: int = 256,
    backend: str | None = None,
    progress: bool | Progress = False,
) -> EdgeScores:
    """Exact patching of each edge alone: ``.scores[edge]`` is ``m_patched - m_clean`` of the metric's mean.

    Args:
        model, clean, corrupted, metric: as :func:`headlab.patch`.
        edges: edge names (``"a0.h1->a2.h0<q>"``), or None for every edge of the graph (expensive: two forwards
            per ``max_rows // B`` edges).
        max_rows: rows per forward (edges stacked times B examples).
        progress: a bar (True), nothing (False) or ``progress(stage, done, total)``. Interrupted (Ctrl-C), the
            result keeps what was measured (NaN elsewhere).
    """
    t0 = time.perf_counter()
    pair, g, clean_out, corrupt_out, m_clean, m_corrupt = _setup(model, clean, corrupted, metric, backend)
    runs.check_gap(m_clean, m_corrupt)
    chosen = _edge_list(g, edges)
    delta = corrupt_out - clean_out
    values = torch.full((g.n_edges,), float("nan"), dtype=torch.float64)
    per = runs.copies_per_forward(pair.n, max_rows)
    done = 0
    try:
        with reporter(progress) as say:
            say("edge patching", 0, len(chosen))
            for chunk in runs.chunks(sorted(chosen, key=lambda i: g.parse(g.edges[i])[1].layer), per):
                vals = _edge_chunk(pair, g, metric, [g.parse(g.edges[i]) for i in chunk], delta, backend)
                for i, v in zip(chunk, vals.mean(1).tolist()):
                    values[i] = v - m_clean
                done += len(chunk)
                say("edge patching", done, len(chosen))
    except KeyboardInterrupt:
        pass
    notes = [
        "each edge patched alone: the receiver's input gets the sender's corrupted-minus-clean output; "
        "everything downstream recomputes"
    ]
    if done < len(chosen):
        notes.append(f"interrupted after {done} of {len(chosen)} edges; the others are NaN")
    elif len(chosen) < g.n_edges:
        notes.append(f"{len(chosen)} of {g.n_edges} edges measured; the others are NaN")
    return EdgeScores(
        model=pair.model_name,
        method="exact",
        metric=getattr(metric, "__name__", "metric"),
        n_examples=pair.n,
        clean=m_clean,
        corrupted=m_corrupt,
        edges=list(g.edges),
        values=values,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


def _add(C: int, n: int, deltas: dict[int, torch.Tensor], head: bool = False):
    """An edit adding ``deltas[c] (B, L, E)`` to copy ``c`` of a stream site (or head 0 of a head_out site)."""

    def edit(t: torch.Tensor, site: str) -> torch.Tensor:
        out = t.clone()
        view = out.view(C, n, *t.shape[1:])
        for c, d in deltas.items():
            if head:
                view[c, :, 0] += d.to(t)
            else:
                view[c] += d.to(t)
        return out

    return edit


def _put(C: int, n: int, values: dict[int, tuple[int | None, torch.Tensor]]):
    """An edit putting ``values[c] = (head or None, tensor of C * B rows)`` into copy ``c``: one head (or all)."""

    def edit(t: torch.Tensor, site: str) -> torch.Tensor:
        out = t.clone()
        view = out.view(C, n, *t.shape[1:])
        for c, (h, src) in values.items():
            s = src.view(C, n, *t.shape[1:])[c].to(t)
            if h is None:
                view[c] = s
            else:
                view[c, :, h] = s[:, h]
        return out

    return edit


class _Stop(Exception):
    """Raised after the last block a first pass needs: the layers above it are not run."""


def _run(pair, C: int, start: int, edits: dict, backend, stop_after: int | None = None):
    """The clean examples with blocks ``>= start`` on ``C`` copies (:func:`fan_out`) and ``edits``; the outputs,
    or None when stopped after block ``stop_after``."""
    a = pair.adapter
    handle = None
    if stop_after is not None:

        def stop(module, args, out):
            raise _Stop

        handle = a.block(stop_after).register_forward_hook(stop)
    try:
        with (
            torch.no_grad(),
            fan_out(a, start, C, share_attention=False),
            a.use_backend(backend or a.backend or "auto"),
            a.hooks(edits),
        ):
            return a.forward(pair.clean)
    except _Stop:
        return None
    finally:
        if handle is not None:
            handle.remove()


def _edge_chunk(pair, g: Graph, metric, configs, delta, backend) -> torch.Tensor:
    """``(C, B)`` metric values for ``C`` edges ``(sender index, receiver)``: blocks below the lowest receiver run
    once, the first pass stops after the highest receiver that needs it."""
    a, C, n = pair.adapter, len(configs), pair.n
    start = min(min(r.layer for _, r in configs), g.n_layers - 1)
    adds: dict[str, dict[int, torch.Tensor]] = {}
    heads: set[str] = set()
    kept: dict[str, torch.Tensor] = {}
    top = -1
    for c, (j, r) in enumerate(configs):
        if r.kind == "logits":
            continue
        if r.kind == "mlp" and not g.parallel[r.layer] and g.heads[r.layer] > 0:
            site = a.site_name(r.layer, "head_out")
            heads.add(site)
        else:
            site = a.site_name(r.layer, "resid_pre")
        adds.setdefault(site, {})[c] = delta[j]
        kept[a.site_name(r.layer, "mlp_out" if r.kind == "mlp" else r.kind)] = None  # type: ignore[assignment]  # a placeholder: the keep hook below fills it first
        top = max(top, r.layer)
    if adds:

        def keep(t, site):
            kept[site] = t.detach().clone()
            return t

        edits = {s: _add(C, n, d, head=s in heads) for s, d in adds.items()}
        first = {**edits, **{s: keep for s in kept}}
        _run(pair, C, start, first, backend, stop_after=top)
    puts: dict[str, dict[int, tuple[int | None, torch.Tensor]]] = {}
    final: dict[int, torch.Tensor] = {}
    for c, (j, r) in enumerate(configs):
        if r.kind == "logits":
            final[c] = delta[j]
            continue
        site = a.site_name(r.layer, "mlp_out" if r.kind == "mlp" else r.kind)
        puts.setdefault(site, {})[c] = (None if r.kind == "mlp" else r.index, kept[site])
    edits = {s: _put(C, n, v) for s, v in puts.items()}
    if final:
        edits[a.site_name(g.n_layers - 1, "resid_post")] = _add(C, n, final)
    outputs = _run(pair, C, start, edits, backend)
    return evaluate(metric, logits_of(outputs), n).detach()


# ---- a set of edges at once ---------------------------------------------------------------------------------


def ablated_outputs(
    clean_out: torch.Tensor, corrupt_out: torch.Tensor, ablation: str, *, seed: int = 0
) -> torch.Tensor:
    """``(S, B, L, E)``: what each sender's output becomes on an ablated edge (see the module docstring)."""
    if ablation == "patch":
        return corrupt_out
    if ablation == "mean":
        return corrupt_out.mean(1, keepdim=True).expand_as(corrupt_out)
    if ablation == "zero":
        return torch.zeros_like(corrupt_out)
    if ablation == "resample":
        B = corrupt_out.shape[1]
        if B < 2:
            raise ConfigError("ablation='resample' takes another pair's corrupted run: give at least 2 pairs")
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(B, generator=gen)
        fixed = perm == torch.arange(B)
        perm[fixed] = (perm[fixed] + 1) % B  # never a pair's own
        return corrupt_out[:, perm]
    raise ConfigError(f"ablation={ablation!r}: choose from {', '.join(ABLATIONS)}")


class _Split:
    """The edits of one split forward (module docstring): ``K`` copies per example, rebuilt at every block."""

    def __init__(self, a, g: Graph, n: int, patched: torch.Tensor, ablated: torch.Tensor) -> None:
        self.a, self.g, self.n = a, g, n
        self.H, self.G = max(g.heads), max(g.kv_heads)
        self.K = 1 + self.H + 2 * self.G + 1
        self.patched = patched  # (n_edges,) bool
        self.ablated = ablated  # (S, B, L, E)
        self.diff = torch.zeros_like(ablated)  # out_s (this run) - ablated_s, filled as the senders run
        self.offsets = g.offsets
        self.first = [g._start[l] for l in range(g.n_layers + 1)]
        self.by_layer: dict[int, list[int]] = {}
        for i, r in enumerate(g.receivers):
            self.by_layer.setdefault(r.layer, []).append(i)

    def _corr(self, i: int) -> torch.Tensor | None:
        r = self.g.receivers[i]
        n_up = self.g.n_upstream(r)
        w = self.patched[self.offsets[i] : self.offsets[i] + n_up]
        if not bool(w.any()):
            return None
        idx = w.nonzero().flatten()
        return self.diff[idx].sum(0)

    def copy_of(self, i: int) -> int:
        r = self.g.receivers[i]
        if r.kind == "q":
            return 1 + r.index
        if r.kind == "k":
            return 1 + self.H + r.index
        if r.kind == "v":
            return 1 + self.H + self.G + r.index
        return self.K - 1

    def view(self, t):
        return t.view(self.K, self.n, *t.shape[1:])

    def resid_pre(self, layer: int):
        def edit(t, site):
            main = self.view(t)[0]
            if layer == 0:
                self.diff[0] = main.to(self.diff) - self.ablated[0]
            out = main.unsqueeze(0).repeat(self.K, *[1] * main.dim())
            for i in self.by_layer[layer]:
                r = self.g.receivers[i]
                if r.kind == "mlp" and not self.g.parallel[layer]:
                    # the MLP reads the stream after attention: earlier senders' corrections here, its own
                    # layer's heads' at head_out
                    corr = self._corr_before(i, self.first[layer])
                else:
                    corr = self._corr(i)
                if corr is not None:
                    out[self.copy_of(i)] -= corr.to(t)
            return out.reshape(t.shape)

        return edit

    def _corr_before(self, i: int, stop: int) -> torch.Tensor | None:
        w = self.patched[self.offsets[i] : self.offsets[i] + stop]
        if not bool(w.any()):
            return None
        return self.diff[w.nonzero().flatten()].sum(0)

    def qkv(self, layer: int, kind: str):
        base = {"q": 1, "k": 1 + self.H, "v": 1 + self.H + self.G}[kind]

        def edit(t, site):
            v = self.view(t)
            picked = torch.stack([v[base + h, :, h] for h in range(t.shape[1])], 1)  # (B, heads, L, d)
            return picked.unsqueeze(0).expand_as(v).reshape(t.shape)

        return edit

    def head_out(self, layer: int):
        def edit(t, site):
            v = self.view(t)
            main = v[0]  # (B, H, L, E): every copy's heads are the same here
            s0 = self.first[layer]
            H = main.shape[1]
            self.diff[s0 : s0 + H] = main.to(self.diff).transpose(0, 1) - self.ablated[s0 : s0 + H]
            if self.g.parallel[layer]:
                return t
            i = self.by_layer[layer][-1]  # the MLP receiver of this layer
            w = self.patched[self.offsets[i] + s0 : self.offsets[i] + s0 + H]
            if not bool(w.any()):
                return t
            out = v.clone()
            for h in w.nonzero().flatten().tolist():
                out[self.K - 1, :, h] = self.ablated[s0 + h].to(t)
            return out.reshape(t.shape)

        return edit

    def mlp_out(self, layer: int):
        def edit(t, site):
            v = self.view(t)
            m = v[self.K - 1]
            self.diff[self.first[layer] + self.g.heads[layer]] = (
                m.to(self.diff) - self.ablated[self.first[layer] + self.g.heads[layer]]
            )
            return m.unsqueeze(0).expand_as(v).reshape(t.shape)

        return edit

    def final(self):
        def edit(t, site):
            main = self.view(t)[0]
            corr = self._corr(len(self.g.receivers) - 1)
            if corr is not None:
                main = main - corr.to(t)
            return main.unsqueeze(0).expand(self.K, *main.shape).reshape(t.shape)

        return edit

    def edits(self) -> dict:
        a, out = self.a, {}
        for l in range(self.g.n_layers):
            out[a.site_name(l, "resid_pre")] = self.resid_pre(l)
            for k in ("q", "k", "v"):
                out[a.site_name(l, k)] = self.qkv(l, k)
            out[a.site_name(l, "head_out")] = self.head_out(l)
            out[a.site_name(l, "mlp_out")] = self.mlp_out(l)
        last = a.site_name(self.g.n_layers - 1, "resid_post")
        out[last] = self.final()
        return out


def patched_metric(pair, g: Graph, metric, patched: torch.Tensor, ablated: torch.Tensor, backend=None) -> torch.Tensor:
    """``(B,)`` metric values of the clean run with the ``patched`` edges (a bool mask over ``g.edges``) reading
    the ``ablated`` sender outputs ``(S, B, L, E)`` and every other edge its sender's output in this run."""
    a = pair.adapter
    if blocks(a) is None:
        from headlab.errors import UnsupportedArchitectureError

        raise UnsupportedArchitectureError(
            f"the blocks of {type(a.model).__name__} are not one layer list: a set of "
            "edges cannot be patched in one forward"
        )
    split = _Split(a, g, pair.n, patched.bool(), ablated)
    with (
        torch.no_grad(),
        fan_out(a, 0, split.K, share_attention=False),
        a.use_backend(backend or a.backend or "auto"),
        a.hooks(split.edits()),
    ):
        outputs = a.forward(pair.clean)
    logits = logits_of(outputs)[: pair.n]
    return evaluate(metric, logits, pair.n)[0].detach()


__all__ = ["ABLATIONS", "ablated_outputs", "edge_patch", "patched_metric"]
