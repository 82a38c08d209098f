"""Attention flow (Abnar and Zuidema 2020): :func:`attention_flow`, exact and fast.

The paper's graph: a node per token per layer plus the input layer (node layer 0 = the input tokens,
node layer t = the output of attention layer t-1), and an edge from node ``(t, i)`` to ``(t-1, j)`` of
capacity ``A_hat_(t-1)[i, j]``, the residual-augmented, row-normalised mean attention
(``(mean_h A + I) / row sum``, as in their code). The flow from an output node ``(t, source)`` to each
input node ``(0, j)`` is one maximum flow per input node; their code then normalises the vector of
flow values to sum 1.

The paper's own code runs networkx's pure-Python Edmonds-Karp once per (output, input) pair. Here
all sinks of one source share one graph in compressed sparse form and each flow is solved by
scipy's compiled Dinic on **integer** capacities ``floor(c * scale)`` (``scale`` = 2^30 / k when
k = 8 or 4 sinks are solved as disjoint copies in one call, for small graphs; a sink whose certificate is
looser than 1e-6 there is solved again alone). That is exact up to a bound that every call checks
(a certificate, not a hope):

* lower bound: the integer flow divided by ``scale`` is a feasible flow of the real capacities
  (every floored capacity is at most the real one), so ``lower <= maxflow``;
* upper bound: the vertices reachable from the source in the integer residual graph form a cut;
  its capacity summed in the *real* capacities is ``>= maxflow``.

``values`` is the cut's capacity; ``gap = max(upper - lower)`` over the sinks (at most 1e-6, usually far below)
is returned with the result. ``solver="networkx"`` runs the paper's Edmonds-Karp on the
same graph, for comparison.

    >>> import numpy as np
    >>> from headlab.interpret.flow.maxflow import flow_values
    >>> A = np.full((2, 3, 3), 1 / 3)                   # two layers, three tokens, uniform rows
    >>> fv = flow_values(A, source=0, source_layer=2)   # every input node can take the whole unit of flow
    >>> fv.values.round(6).tolist(), fv.gap < 1e-6
    ([1.0, 1.0, 1.0], True)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

import headlab.checks as checks
from headlab.errors import ConfigError, MemoryBudgetError
from headlab.interpret.flow.record import prepare, record
from headlab.interpret.flow.rollout import augment, layer_matrices
from headlab.interpret.flow.stacks import PerStack
from headlab.models.loader import resolve
from headlab.progress import Progress, increments, reporter
from headlab.results import envelope
from headlab.spec.memory_guard import available_memory, human_bytes

BYTES_PER_EDGE = {"scipy": 72, "networkx": 600}  # measured order of magnitude, both directions included
_SOURCE = "source token {value!r} out of range for {length} tokens (0..{high})"


@dataclass
class FlowValues:
    """Raw max-flow values ``(n,)`` from one output node to every input node, and the certificate gap."""

    values: np.ndarray
    gap: float
    solver: str
    seconds: float


@dataclass
class FlowResult:
    """What :func:`attention_flow` returns: ``flow`` ``(n,)`` (normalised to sum 1) from token ``source``
    at the output of layer ``layer`` to every input token."""

    source: int
    layer: int
    n: int
    tokens: list[str] | None
    flow: torch.Tensor
    values: torch.Tensor
    gap: float
    solver: str
    seconds: float
    stack: str | None = None  # the stack it ran within, on a model of several (an encoder-decoder)

    def _repr_html_(self) -> str:
        """This result's page inline in a notebook (headlab's shell in a sandboxed frame; no network)."""
        from headlab.interpret import shell
        from headlab.interpret.flow.page import flow_page

        return shell.inline(flow_page(self))

    def to_json(self) -> dict:
        return envelope(
            "attention_flow",
            {
                "source": self.source,
                "layer": self.layer,
                "n": self.n,
                "tokens": self.tokens,
                "flow": self.flow.tolist(),
                "values": self.values.tolist(),
                "gap": self.gap,
                "solver": self.solver,
                "seconds": self.seconds,
                **({"stack": self.stack} if self.stack is not None else {}),
            },
            settings={"source": self.source, "layer": self.layer, "solver": self.solver},
        )


def estimate_bytes(n: int, layers: int, solver: str = "scipy") -> int:
    """Memory of the flow graph for ``n`` tokens through ``layers`` layers (dense attention)."""
    return int(layers * n * n * BYTES_PER_EDGE[solver] + 16 * n * (layers + 1))


def _check_memory(n: int, layers: int, solver: str, limit: int | None) -> None:
    need = estimate_bytes(n, layers, solver)
    have = available_memory() if limit is None else int(limit)
    if need > 0.8 * have:
        raise MemoryBudgetError(
            f"attention flow over {layers} layers of {n} tokens ({layers * n * n:,} edges) needs about "
            f"{human_bytes(need)} with solver {solver!r}, but only {human_bytes(have)} is available; "
            f"use rollout (headlab.rollout(..., rows=[...])) for long inputs, or a shorter text",
            estimate_bytes=need,
            available_bytes=have,
            alternative="rollout",
        )


def _check_graph(A: np.ndarray, source: int, source_layer: int) -> tuple[int, int]:
    if A.ndim != 3 or A.shape[1] != A.shape[2]:
        raise ConfigError(f"the layer matrices must have shape (layers, n, n), got {A.shape}")
    L, n, _ = A.shape
    if not isinstance(source_layer, (int, np.integer)) or not 0 <= source_layer <= L:
        raise ConfigError(f"source_layer {source_layer!r} out of range: node layers are 0 (the input) .. {L}")
    if source_layer == 0:
        raise ConfigError(
            "the output node is in the input layer (node layer 0): flow goes from a node of layer "
            f"1..{L} down to the input tokens; pick source_layer >= 1"
        )
    checks.index("source token", source, n, negative=False, message=_SOURCE)
    return L, n


def _edges(A: np.ndarray, S: int, n: int):
    """The layered graph through node layer S: edges ``(from, to, capacity)`` over ``(S + 1) * n`` nodes."""
    rows, cols, caps = [], [], []
    for t in range(1, S + 1):
        i, j = np.nonzero(A[t - 1] > 0)
        rows.append(t * n + i)
        cols.append((t - 1) * n + j)
        caps.append(A[t - 1][i, j])
    return np.concatenate(rows), np.concatenate(cols), np.concatenate(caps).astype(np.float64)


def _batch(n: int, S: int) -> int:
    """Sinks solved together as disjoint copies of the graph (one solver call): small graphs only, where
    the call's fixed cost dominates."""
    edges = S * n * n
    return 8 if edges <= 5_000 else 4 if edges <= 200_000 else 1


def _solve_group(src, dst, cap, N, u, group):
    """One solver call for the sinks in ``group`` (disjoint copies): ``[(upper, lower), ...]``."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import breadth_first_order, maximum_flow

    m = len(group)
    scale = float(2**30 // m)
    icap = np.floor(cap * scale).astype(np.int32)
    off = (np.arange(m) * N)[:, None]
    s_star, t_star = m * N, m * N + 1
    big = np.int32(2**31 - 1)  # never saturated: a copy's flow is at most 1 * scale, all of them 2^30
    r = np.concatenate([(src + off).ravel(), np.full(m, s_star), np.asarray(group) + off.ravel()])
    c = np.concatenate([(dst + off).ravel(), u + off.ravel(), np.full(m, t_star)])
    d = np.concatenate([np.tile(icap, m), np.full(2 * m, big, dtype=np.int32)])
    G = csr_matrix((d, (r, c)), shape=(m * N + 2, m * N + 2))
    G.sort_indices()
    res = maximum_flow(G, s_star, t_star, method="dinic")
    resid = (G - res.flow).tocsr()  # residual capacities; reverse arcs carry the flow back
    resid.data = (resid.data > 0).astype(np.int8)
    resid.eliminate_zeros()
    reach = np.zeros(m * N + 2, dtype=bool)
    reach[breadth_first_order(resid, s_star, directed=True, return_predecessors=False)] = True
    out = res.flow[s_star].toarray().ravel()
    got = []
    for i in range(m):
        rc = reach[i * N : (i + 1) * N]
        got.append((float(cap[rc[src] & ~rc[dst]].sum()), out[u + i * N] / scale))  # the copy's cut, real capacities
    return got


def _scipy(A, source, S, n, sinks, say, tol=1e-6):
    """Disjoint copies of the graph, one per sink of a batch, joined by a super source and a super sink:
    a maximum flow of the union is a maximum flow of every copy. Integer capacities ``floor(c * scale)``
    with ``scale = 2^30 / k`` keep the flow of all k copies within 2^30 (scipy solves in int32). A sink whose
    certificate gap exceeds ``tol`` in a batch is solved again alone, at the finer scale."""
    src, dst, cap = _edges(A, S, n)
    N = (S + 1) * n
    u = S * n + source
    vals = np.zeros(n)
    gap = 0.0
    sinks = list(sinks)
    k = _batch(n, S)
    for b0 in range(0, len(sinks), k):
        group = sinks[b0 : b0 + k]
        for v, (upper, lower) in zip(group, _solve_group(src, dst, cap, N, u, group)):
            if upper - lower > tol and len(group) > 1:
                upper, lower = _solve_group(src, dst, cap, N, u, [v])[0]
            vals[v] = upper
            gap = max(gap, float(upper - lower))
        say("max flow", b0 + len(group), len(sinks))
    return vals, gap


def networkx_graph(A: np.ndarray, S: int | None = None):
    """The paper's graph as a networkx DiGraph (edge attribute ``capacity``), nodes ``t * n + i``."""
    import networkx as nx

    L, n, _ = A.shape
    S = L if S is None else S
    G = nx.DiGraph()
    G.add_nodes_from(range((S + 1) * n))
    for t in range(1, S + 1):
        i, j = np.nonzero(A[t - 1] > 0)
        G.add_edges_from(
            (int(t * n + a), int((t - 1) * n + b), {"capacity": float(A[t - 1][a, b])}) for a, b in zip(i, j)
        )
    return G


def _networkx(A, source, S, n, sinks, say):
    import networkx as nx
    from networkx.algorithms.flow import edmonds_karp

    G = networkx_graph(A, S)
    vals = np.zeros(n)
    for done, v in enumerate(sinks, 1):
        vals[v] = nx.maximum_flow_value(G, S * n + source, int(v), flow_func=edmonds_karp)
        say("max flow", done, len(sinks))
    return vals, 0.0


def flow_values(
    A_hat,
    source: int,
    source_layer: int,
    *,
    solver: str = "scipy",
    sinks=None,
    progress: bool | Progress | None = None,
    memory_limit: int | None = None,
) -> FlowValues:
    """Max-flow values from node ``(source_layer, source)`` to every input node ``(0, j)``.

    Args:
        A_hat: ``(L, n, n)`` capacities (numpy or torch); ``A_hat[t-1][i, j]`` is the edge ``(t, i) -> (t-1, j)``.
        source: the output token; source_layer: its node layer, ``1..L`` (0 is the input layer: refused).
        solver: ``"scipy"`` (compiled Dinic, certified exact) or ``"networkx"`` (the paper's Edmonds-Karp).
        sinks: input tokens to solve for (default all); others stay 0.
        progress: a bar (True), nothing (None, False) or ``progress("max flow", sinks solved, sinks)``
            (:mod:`headlab.progress`); the older ``progress(k)``, called with the sinks solved since the last
            call, still works.
        memory_limit: bytes the graph may take (default: what the machine has available).
    """
    A = (
        A_hat.detach().double().cpu().numpy()
        if isinstance(A_hat, torch.Tensor)
        else np.asarray(A_hat, dtype=np.float64)
    )
    L, n = _check_graph(A, source, source_layer)
    if solver not in ("scipy", "networkx"):
        raise ConfigError(f"unknown flow solver {solver!r}; use 'scipy' (fast, certified) or 'networkx' (the paper's)")
    if not np.isfinite(A).all() or (A < 0).any():
        raise ConfigError("capacities must be finite and non-negative")
    _check_memory(n, int(source_layer), solver, memory_limit)
    sinks = range(n) if sinks is None else [int(s) for s in sinks]
    t0 = time.perf_counter()
    fn = _scipy if solver == "scipy" else _networkx
    with reporter(progress, legacy=increments) as say:
        say("max flow", 0, len(sinks))
        vals, gap = fn(A, int(source), int(source_layer), n, sinks, say)
    return FlowValues(vals, gap, solver, time.perf_counter() - t0)


def attention_flow(
    loaded,
    text_or_inputs,
    *,
    source: int = 0,
    layer: int = -1,
    solver: str = "scipy",
    backend="auto",
    progress: bool | Progress | None = None,
    memory_limit: int | None = None,
    stack: str | None = None,
) -> FlowResult | PerStack:
    """Normalised attention flow ``(n,)`` from token ``source`` at the output of layer ``layer`` to every
    input token (see the module docstring).

    Args:
        loaded: a :class:`~headlab.models.loader.LoadedModel`, a model adapter or a supported model.
        text_or_inputs: one text (with a LoadedModel), an ``input_ids`` tensor ``(1, n)`` or a dict.
        source: the output token (default 0, [CLS] for BERT-style models; negatives count from the end).
        layer: the attention layer whose output holds the source node (default the last).
        solver: ``"scipy"`` (default) or ``"networkx"`` (the paper's algorithm, for comparison).
        progress: as for :func:`flow_values` (the input tokens solved; the CLI's bar).
        memory_limit: bytes the graph may take; the estimate is checked before anything is allocated (for
            patch or frame inputs, after the attention maps are recorded: the model alone says their number).
        stack: for an encoder-decoder, ``"encoder"`` or ``"decoder"`` (self-attention), as for rollout (the
            result's ``stack`` names it). None on an encoder-decoder: a
            :class:`~headlab.interpret.flow.stacks.PerStack` ``{"encoder": FlowResult, "decoder": FlowResult}``,
            each what naming that stack gives (``source`` and ``layer`` taken within each stack), with notes
            saying so; cross-attention does not chain and is left out.
    """
    from headlab.interpret.flow.stacks import each_stack, several_stacks

    again = dict(
        source=source, layer=layer, solver=solver, backend=backend, progress=progress, memory_limit=memory_limit
    )
    if stack is None and several_stacks(resolve(loaded)[0]):
        return each_stack(resolve(loaded)[0], lambda s: flow_one(loaded, text_or_inputs, **again, stack=s), "flow")  # type: ignore[arg-type]
    return flow_one(loaded, text_or_inputs, **again, stack=stack)  # type: ignore[arg-type]


def flow_one(
    loaded,
    text_or_inputs,
    *,
    source: int = 0,
    layer: int = -1,
    solver: str = "scipy",
    backend="auto",
    progress: bool | Progress | None = None,
    memory_limit: int | None = None,
    stack: str | None = None,
) -> FlowResult:
    """:func:`attention_flow` within one stack: the model's only one, or the one named (an encoder-decoder without
    ``stack=`` is a :class:`~headlab.errors.ConfigError` asking for one)."""
    from headlab.interpret.flow.rollout import stack_layers

    adapter, loaded_model = resolve(loaded)
    chain = stack_layers(
        adapter, stack
    )  # the layers that chain: the one stack, or an encoder-decoder's encoder/decoder
    L = len(chain)
    top = checks.index(
        "layer",
        layer,
        L,
        message="layer {value!r} out of range: the model has {length} layers "
        "(0..{high}, or -1 for the last); the input layer holds no output node",
    )
    inputs, _ = prepare(loaded_model, adapter, text_or_inputs)
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
    if stack == "decoder" and isinstance(inputs, dict):  # the decoder's own tokens (its ids, else the input's shifted)
        ids = inputs.get("decoder_input_ids", ids)
    rec = None
    if ids is None:  # patches or audio frames: the model says how many positions (its maps are small beside the graph)
        rec = record(loaded, text_or_inputs, chain[: top + 1], maps=True, backend=backend)
    if ids is not None:
        n = int(ids.shape[1])
    else:
        assert rec is not None  # recorded just above
        n = rec.n
    checks.index("source token", source, n, message=_SOURCE)
    _check_memory(n, top + 1, solver if solver in BYTES_PER_EDGE else "scipy", memory_limit)
    if rec is None:
        rec = record(loaded, text_or_inputs, chain[: top + 1], maps=True, backend=backend)
    with torch.no_grad():
        A = augment(layer_matrices(rec, "mean"))  # (top + 1, n, n)
    fv = flow_values(A, source % n, top + 1, solver=solver, progress=progress, memory_limit=memory_limit)
    vals = torch.from_numpy(fv.values)  # float64
    total = vals.sum()
    flow = vals / total if total > 0 else vals
    named = stack if len(adapter.stacks) > 1 else None
    return FlowResult(source % n, top, n, rec.tokens, flow, vals, fv.gap, fv.solver, fv.seconds, named)


__all__ = ["FlowResult", "FlowValues", "attention_flow", "estimate_bytes", "flow_one", "flow_values", "networkx_graph"]
