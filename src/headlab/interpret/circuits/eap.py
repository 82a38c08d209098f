"""Edge attribution patching (EAP, Syed et al. 2023) and EAP with integrated gradients (EAP-IG, Hanna et al. 2024).

Patching edge ``s -> r`` adds ``delta_s = out_s(corrupted) - out_s(clean)`` to receiver ``r``'s input only. Its
first-order estimate, for every edge at once::

    score(s -> r)  =  sum_{b, i}  delta_s[b, i] . d m / d x_r[b, i]          (at the clean run)

where ``x_r`` is the stream as ``r`` reads it (before the block's norm) and ``m`` the metric's mean over the
examples. One clean forward and one backward give ``d m / d q_h`` (and ``k``, ``v``, the MLP's output, the final
stream); each receiver's input gradient is then one local vector-Jacobian product through its own layer's
norm and projection (``x_r -> q_h`` only, never the model again): the gradient TransformerLens gets by
running a copy of the stream per head (``use_split_qkv_input``), without the copies.

EAP-IG (``steps`` = m) averages that gradient over m points of a straight path between the two runs:

- ``"inputs"`` (Hanna et al. 2024, as their code does it): the input embeddings at ``corrupted + (k/m) (clean -
  corrupted)`` for ``k = 0 .. m-1`` (the corrupted end included, the clean end not), everything else recomputed;
- ``"activations"``: every sender's output set to ``clean + (k/m) (corrupted - clean)``, ``k = 0 .. m-1``, all at
  once (values interpolated, the gradient still taken through the model); ``steps=1`` is EAP. Hanna et al.'s
  code interpolates one layer's node at a time instead (m runs per node): a different average of the same kind.

Either way the scores add up, as m grows, to the whole change: the edges out of ``input`` (inputs) or into
``logits`` (activations) sum to ``m_corrupted - m_clean`` (completeness, tested).

Memory: the senders' differences ``(S, B, L, E)`` and one layer's receiver gradients; nothing grows with the
attention maps times the edges.
"""

from __future__ import annotations

import time

import torch

import headlab.checks as checks
from headlab.errors import ConfigError
from headlab.interpret.circuits import nodes
from headlab.interpret.circuits.graph import Graph
from headlab.interpret.circuits.graph import graph as build_graph
from headlab.interpret.circuits.result import EdgeScores
from headlab.interpret.patching import runs
from headlab.interpret.patching.metrics import evaluate, logits_of
from headlab.progress import Progress, reporter

METHODS = ("eap", "eap-ig", "exact")
IG_KINDS = ("inputs", "activations")


class _Stash:
    """Edits that keep the live tensors of one forward (and optionally replace values, keeping the gradient)."""

    def __init__(self, adapter, graph: Graph, replace: dict | None = None) -> None:
        self.a, self.g = adapter, graph
        self.replace = replace or {}  # site -> tensor the value is set to (gradient kept through the model)
        self.live: dict[str, torch.Tensor] = {}

    def edit(self, t: torch.Tensor, site: str) -> torch.Tensor:
        target = self.replace.get(site)
        if target is not None:
            t = t + (target.to(t) - t).detach()
        if site.endswith(".resid_pre") and not t.requires_grad:
            t = t.detach().requires_grad_()  # the receivers' local products start here
        self.live[site] = t
        return t

    def edits(self) -> dict:
        a, names = self.a, []
        for l in range(self.g.n_layers):
            names += [a.site_name(l, k) for k in ("resid_pre", "q", "k", "v", "mlp_out")]
            if not self.g.parallel[l] or a.site_name(l, "head_out") in self.replace:
                names.append(a.site_name(l, "head_out"))
        names.append(a.site_name(self.g.n_layers - 1, "resid_post"))
        return {n: self.edit for n in names}


def _receiver_grads(stash: _Stash, value: torch.Tensor):
    """``d value / d x_r`` for every receiver, ``(B, L, E)`` each, in :attr:`Graph.receivers` order: yielded one
    layer's receivers at a time (the logits last), so only one layer's gradients are held."""
    a, g, live = stash.a, stash.g, stash.live
    outs = [live[a.site_name(l, k)] for l in range(g.n_layers) for k in ("q", "k", "v", "mlp_out")]
    final = live[a.site_name(g.n_layers - 1, "resid_post")]
    grads = torch.autograd.grad(value, outs + [final], retain_graph=True, allow_unused=True)
    got = [torch.zeros_like(o) if d is None else d for o, d in zip(outs + [final], grads)]
    for l in range(g.n_layers):
        R = live[a.site_name(l, "resid_pre")]
        layer: list[torch.Tensor] = []
        for j in range(3):  # q, k, v: one local product per head (kv head)
            out, d = outs[4 * l + j], got[4 * l + j]  # (B, heads, L, dh)
            for h in range(out.shape[1]):
                mask = torch.zeros_like(d)
                mask[:, h] = d[:, h]
                (gr,) = torch.autograd.grad(out, R, grad_outputs=mask, retain_graph=True, allow_unused=True)
                layer.append(torch.zeros_like(R) if gr is None else gr.detach())
        mlp_out, d = outs[4 * l + 3], got[4 * l + 3]
        src = R if g.parallel[l] or g.heads[l] == 0 else live[a.site_name(l, "head_out")]
        (gr,) = torch.autograd.grad(mlp_out, src, grad_outputs=d, retain_graph=True, allow_unused=True)
        if gr is None:
            gr = torch.zeros_like(R)
        elif gr.dim() == 4:  # d/d head_out[:, h] is the same for every head: the stream after attention
            gr = gr[:, 0]
        layer.append(gr.detach())
        yield layer
    yield [got[-1].detach()]


def _layer_scores(graph: Graph, flat: torch.Tensor, first: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``delta_s . grad_r`` for the receivers ``first ..`` of one layer: one product against the senders the widest
    of them reads; ``flat`` is the senders' differences ``(S, B * L * E)``."""
    receivers = graph.receivers[first : first + len(grads)]
    widest = max(graph.n_upstream(r) for r in receivers)
    G = torch.stack([g.reshape(-1) for g in grads], 1).to(flat.dtype)  # (B * L * E, receivers)
    prod = (flat[:widest] @ G).double()  # (senders, receivers)
    return [prod[: graph.n_upstream(r), k] for k, r in enumerate(receivers)]


def _clean_pass(pair, graph, inputs, metric, replace, backend, delta: torch.Tensor) -> torch.Tensor:
    """One forward and backward: ``(n_edges,)`` float64 scores ``delta_s . d metric / d x_r``."""
    stash = _Stash(pair.adapter, graph, replace)
    flat = delta.reshape(delta.shape[0], -1)
    out: list[torch.Tensor] = []
    with (
        pair.adapter.use_backend(backend or pair.adapter.backend or "auto"),
        pair.adapter.hooks(stash.edits()),
        torch.enable_grad(),
    ):
        outputs = pair.adapter.forward(inputs)
        value = evaluate(metric, logits_of(outputs), pair.n).mean()
        first = 0
        for grads in _receiver_grads(stash, value):
            out += _layer_scores(graph, flat, first, grads)
            first += len(grads)
    return torch.cat(out)


def edge_scores(
    model,
    clean,
    corrupted,
    metric,
    *,
    method: str = "eap",
    steps: int = 5,
    ig: str = "inputs",
    edges=None,
    max_rows: int = 256,
    backend: str | None = None,
    progress: bool | Progress = False,
) -> EdgeScores:
    """Score every edge of ``model``'s graph for the patch corrupted -> clean.

    Args:
        model: a LoadedModel, an ``nn.Module`` of a served family, or an adapter (a pre-norm decoder).
        clean, corrupted: as :func:`headlab.patch` takes them (same shapes and padding; position i patched by i).
        metric: ``metric(logits (B, L, V)) -> (B,)``; scores estimate the change of its mean.
        method: ``"eap"`` (one clean forward, one corrupted forward, one backward), ``"eap-ig"`` (``steps`` of them,
            ``ig="inputs"`` or ``"activations"``) or ``"exact"`` (:func:`~headlab.interpret.circuits.patching.edge_patch`,
            ``edges`` or every edge).
        max_rows: rows per forward of exact patching.

    Returns:
        :class:`~headlab.interpret.circuits.result.EdgeScores`: ``.scores`` maps ``"a0.h1->a3.h2<q>"`` to the
        estimated (or exact) ``m_patched - m_clean``.

        >>> import torch
        >>> from headlab.models.transformer import Transformer, TransformerConfig
        >>> from headlab.interpret.patching import logit_diff
        >>> _ = torch.manual_seed(0)
        >>> m = Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, causal=True)).eval()
        >>> r = edge_scores(m, torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]]), logit_diff(2, 5))
        >>> len(r.scores), r.method
        (46, 'eap')
    """
    if method not in METHODS:
        raise ConfigError(f"method={method!r}: choose from {', '.join(METHODS)}")
    if method == "exact":
        from headlab.interpret.circuits.patching import edge_patch

        return edge_patch(
            model, clean, corrupted, metric, edges=edges, max_rows=max_rows, backend=backend, progress=progress
        )
    if edges is not None:
        raise ConfigError("edges= chooses the edges of exact patching; EAP and EAP-IG score every edge at once")
    if method == "eap-ig":
        checks.int_in_range(
            "steps",
            steps,
            1,
            1000,
            message="steps={value!r}: give a whole number of interpolation "
            "steps from 1 to 1000 (Hanna et al. use 5 to 100)",
        )
        if ig not in IG_KINDS:
            raise ConfigError(f"ig={ig!r}: choose 'inputs' (interpolate the input embeddings) or 'activations'")
    else:
        steps = 1
    t0 = time.perf_counter()
    pair = runs.prepare(model, clean, corrupted)
    g = build_graph(pair.adapter)
    a = pair.adapter
    with torch.no_grad():
        clean_out, clean_run = nodes.record(pair, g, pair.clean, backend)
        corrupt_out, corrupt_run = nodes.record(pair, g, pair.corrupted, backend)
        m_clean = float(evaluate(metric, logits_of(clean_run), pair.n).mean())
        m_corrupt = float(evaluate(metric, logits_of(corrupt_run), pair.n).mean())
    runs.check_gap(m_clean, m_corrupt)
    delta = corrupt_out.sub_(clean_out)  # (S, B, L, E), in place: one copy of the senders' outputs less
    if not (method == "eap-ig" and ig == "activations"):
        clean_out = clean_out[:1].clone()  # only the input's clean output is read again
    total = None
    with reporter(progress) as say:
        for k in range(steps):
            replace = {}
            if ig == "inputs" and method == "eap-ig":  # corrupted + (k / m) (clean - corrupted)
                replace[a.site_name(0, "resid_pre")] = clean_out[0] + (1 - k / steps) * delta[0]
            elif k > 0:  # activations: every sender's output moved along its own straight line
                alpha = k / steps
                replace[a.site_name(0, "resid_pre")] = clean_out[0] + alpha * delta[0]
                i = 1
                for l, H in enumerate(g.heads):
                    replace[a.site_name(l, "head_out")] = (clean_out[i : i + H] + alpha * delta[i : i + H]).transpose(
                        0, 1
                    )
                    replace[a.site_name(l, "mlp_out")] = clean_out[i + H] + alpha * delta[i + H]
                    i += H + 1
            part = _clean_pass(pair, g, pair.clean, metric, replace, backend, delta)
            total = part if total is None else total + part
            say("edge attribution" if steps == 1 else "EAP-IG steps", k + 1, steps)
    assert total is not None  # steps >= 1
    scores = total / steps
    where = (
        "at the clean run"
        if method == "eap"
        else f"averaged over {steps} points from the corrupted input towards the clean one (Hanna et al.'s EAP-IG)"
        if ig == "inputs"
        else f"averaged over {steps} points from the clean run towards the corrupted one, "
        "every sender's output interpolated"
    )
    notes = ["first-order estimate: (out_corrupted - out_clean) of the sender . d metric / d receiver input, " + where]
    return EdgeScores(
        model=pair.model_name,
        method=method,
        metric=getattr(metric, "__name__", "metric"),
        n_examples=pair.n,
        clean=m_clean,
        corrupted=m_corrupt,
        edges=list(g.edges),
        values=scores,
        steps=steps,
        ig=ig if method == "eap-ig" else None,
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


__all__ = ["IG_KINDS", "METHODS", "edge_scores"]
