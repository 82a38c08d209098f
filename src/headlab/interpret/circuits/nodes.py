"""What the senders write: each node's output on a run, and the forward with stashed live tensors.

``record(pair, inputs)`` runs the model once (no gradients) and returns ``(S, B, L, E)``: for every sender of
the :class:`~headlab.interpret.circuits.graph.Graph` in order, what it adds to the residual stream (the input
embedding stream entering block 0, each head's ``head_out``, each MLP's ``mlp_out``). Differences of two such
recordings are what an edge carries when its sender is patched.
"""

from __future__ import annotations

import torch

from headlab.interpret.capture import capture
from headlab.interpret.circuits.graph import Graph


def sites(adapter, graph: Graph) -> list[str]:
    names = [adapter.site_name(0, "resid_pre")]
    for l in range(graph.n_layers):
        names += [adapter.site_name(l, "head_out"), adapter.site_name(l, "mlp_out")]
    return names


def stack(adapter, graph: Graph, cache) -> torch.Tensor:
    """``(S, B, L, E)`` sender outputs in :attr:`Graph.senders` order, from a cache of :func:`sites`; float32
    (float64 for a float64 model)."""
    first = cache[adapter.site_name(0, "resid_pre")]
    dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
    parts = [first.to(dtype).unsqueeze(0)]
    for l in range(graph.n_layers):
        parts.append(cache[adapter.site_name(l, "head_out")].to(dtype).transpose(0, 1))  # (H, B, L, E)
        parts.append(cache[adapter.site_name(l, "mlp_out")].to(dtype).unsqueeze(0))
    return torch.cat(parts)


def record(pair, graph: Graph, inputs, backend=None) -> tuple[torch.Tensor, object]:
    """``(sender outputs (S, B, L, E), the run's outputs)`` of one forward on ``inputs``."""
    cache = capture(pair.adapter, inputs, sites(pair.adapter, graph), backend=backend)
    return stack(pair.adapter, graph, cache), cache.outputs


__all__ = ["record", "sites", "stack"]
