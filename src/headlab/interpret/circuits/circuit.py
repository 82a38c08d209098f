"""A circuit: a set of edges of a model's component graph, the nodes they connect, and how it was chosen.

**Nodes of an edge.** An edge ``s -> r`` runs from sender ``s`` (``input``, ``a{l}.h{h}``, ``m{l}``) to a
receiver ``r`` (a node's input). The receiver belongs to a node::

    a3.h2<q>   ->  a3.h2                      (a query head's own input)
    a3.h1<k>   ->  every query head of kv group 1 of layer 3: a3.h{1*G} .. a3.h{2*G - 1}, G = H / Hkv
    a3.h1<v>   ->  the same heads (on a model without grouped-query attention G = 1: a3.h1<k> -> a3.h1)
    m3         ->  m3
    logits     ->  logits

so on a grouped-query model an edge into ``a3.h1<k>`` feeds each query head of that group; which of them it
counts for is settled by the paths (next paragraph): those heads of the group that lie on a path to the logits.

**Paths and pruning** (Hanna et al. 2024's ``Graph.prune``, which MIB applies to every circuit it scores). A node
is *on a path* when a chain of circuit edges leads from ``input`` to it and another from it to ``logits``. An
edge ``s -> r`` is on a path when ``s`` is reached from ``input`` and one of ``r``'s nodes reaches ``logits``.
:meth:`Circuit.prune` keeps only such edges; :attr:`Circuit.nodes` lists the nodes on a path. A dangling edge
changes nothing under ``"patch"`` ablation: a sender none of whose inputs is in the circuit reads the corrupted
stream, so it writes its corrupted output, which is what its ablated edges carry anyway.

    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> from headlab.interpret.circuits.graph import graph
    >>> g = graph(Transformer(TransformerConfig(n_layers=2, n_heads=4, n_kv_heads=2, causal=True)))
    >>> c = Circuit.of(g, ["input->a0.h1<k>", "a0.h3->logits", "a1.h0->m1"])
    >>> c.nodes  # a0.h1<k> feeds a0.h2 and a0.h3 (kv group 1); a0.h3 reaches the logits
    ['input', 'a0.h3', 'logits']
    >>> c.prune().edges  # a1.h0 is never reached from the input, m1 never reaches the logits
    ['input->a0.h1<k>', 'a0.h3->logits']
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from headlab.errors import ConfigError, InputError
from headlab.interpret.circuits.graph import Graph, head, mlp
from headlab.results import Result

METHODS = ("top-n", "greedy", "acdc", "manual")  # how a circuit was chosen; "manual": given edge by edge


# ---- paths over a graph, on edge masks ----------------------------------------------------------------------


def receiver_nodes(g: Graph) -> list[list[int]]:
    """Per receiver (in :attr:`Graph.receivers` order), the nodes it feeds, as sender indices (the logits are
    ``len(g.senders)``): a q receiver its head, a k or v receiver every query head of its kv group."""
    out = []
    S = len(g.senders)
    for r in g.receivers:
        if r.kind == "logits":
            out.append([S])
        elif r.kind == "mlp":
            out.append([g.sender_index(mlp(r.layer))])
        elif r.kind == "q":
            out.append([g.sender_index(head(r.layer, r.index))])
        else:
            G = g.heads[r.layer] // g.kv_heads[r.layer]  # query heads per kv head: head h reads kv head h // G
            out.append([g.sender_index(head(r.layer, h)) for h in range(r.index * G, (r.index + 1) * G)])
    return out


def paths(g: Graph, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(edges on a path (n_edges,) bool, reached from input (S + 1,) bool, reaching logits (S + 1,) bool)`` for
    the circuit ``mask`` (``(n_edges,)`` bool over ``g.edges``); node ``S`` is the logits.

    Senders are numbered in the order the stream receives them, which is a topological order: one pass over the
    receivers forwards settles "reached from input", one pass backwards "reaches logits".
    """
    mask = _check_mask(g, mask)
    S = len(g.senders)
    targets = receiver_nodes(g)
    offsets = g.offsets
    fwd = torch.zeros(S + 1, dtype=torch.bool)
    fwd[0] = True  # the input
    for i, r in enumerate(g.receivers):  # every sender upstream of r is settled before r's nodes
        n = g.n_upstream(r)
        if bool((mask[offsets[i] : offsets[i] + n] & fwd[:n]).any()):
            fwd[targets[i]] = True
    bwd = torch.zeros(S + 1, dtype=torch.bool)
    bwd[S] = True
    live = torch.zeros(len(g.receivers), dtype=torch.bool)
    for i in range(len(g.receivers) - 1, -1, -1):  # a node's out-edges all go to later receivers
        if bool(bwd[targets[i]].any()):
            live[i] = True
            n = g.n_upstream(g.receivers[i])
            bwd[:n] |= mask[offsets[i] : offsets[i] + n]
    keep = torch.zeros_like(mask)
    for i, r in enumerate(g.receivers):
        if live[i]:
            n = g.n_upstream(r)
            keep[offsets[i] : offsets[i] + n] = mask[offsets[i] : offsets[i] + n] & fwd[:n]
    return keep, fwd, bwd


def on_paths(g: Graph, mask: torch.Tensor) -> torch.Tensor:
    """``(n_edges,)`` bool: the edges of ``mask`` on a path from the input to the logits (the pruned circuit)."""
    return paths(g, mask)[0]


def _check_mask(g: Graph, mask) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.shape != (g.n_edges,):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ConfigError(f"an edge mask is a bool tensor of shape ({g.n_edges},) over the graph's edges; got {shape}")
    return mask.bool().cpu()


# ---- the result ---------------------------------------------------------------------------------------------

_EDGE = re.compile(r"^(input|a\d+\.h\d+|m\d+)->(a\d+\.h\d+<[qkv]>|m\d+|logits)$")


@dataclass
class Circuit:
    """A circuit of ``model``'s component graph (see the module docstring for nodes and paths).

    Attributes:
        model: the model's name. edges: edge names (``"a0.h1->a2.h0<q>"``), in the graph's order.
        heads, kv_heads, parallel: the graph's layout per layer (enough to rebuild it: :meth:`graph`).
        n_graph_edges: how many edges the whole graph has.
        method: ``"top-n"``, ``"greedy"``, ``"acdc"`` (:func:`~headlab.interpret.circuits.discovery.discover`) or
            ``"manual"`` (:meth:`of`).
        scores: ``{edge: score}`` it was chosen by: for top-n and greedy the edge scores (estimated
            ``m_patched - m_clean`` of the edge alone) of the chosen edges; for ACDC, for every edge it tried, how
            much removing it grew the criterion (KL divergence or ``|metric change|``).
        ablation: what an edge outside the circuit carries: ``"patch"``, ``"mean"``, ``"resample"``, ``"zero"``.
        metric: the metric's name. clean, corrupted: its means on the two runs. empty: its mean with every edge
            ablated. circuit_metric: with every edge outside the circuit ablated (None: not measured).
        settings: what the method was asked (n_edges, threshold, criterion, score method, ...).
        seconds: wall time. notes: what to know when reading it.
    """

    model: str
    edges: list[str]
    heads: list[int]
    kv_heads: list[int]
    parallel: list[bool]
    n_graph_edges: int
    method: str = "manual"
    scores: dict[str, float] = field(default_factory=dict)
    ablation: str = "patch"
    metric: str = "metric"
    clean: float | None = None
    corrupted: float | None = None
    empty: float | None = None
    circuit_metric: float | None = None
    settings: dict = field(default_factory=dict)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    kind = "circuit"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method={self.method!r}: a circuit is chosen by one of {', '.join(METHODS)}")
        bad = [e for e in self.edges if not isinstance(e, str) or not _EDGE.match(e)]
        if bad:
            raise ConfigError(
                f"{bad[0]!r} is not an edge name: give 'sender->receiver' such as 'input->a0.h1<q>', "
                "'a0.h1->a2.h0<k>', 'm1->m2' or 'a1.h3->logits'"
            )
        seen: set[str] = set()
        for e in self.edges:
            if e in seen:
                raise ConfigError(f"edge {e!r} is listed twice; a circuit is a set of edges")
            seen.add(e)
        self._graph: Graph | None = None

    @classmethod
    def of(cls, g: Graph, edges, **fields) -> Circuit:
        """A circuit of graph ``g`` from edge names (a hand-built one: ``method="manual"`` unless given).

        ``edges``: names, or a ``(n_edges,)`` bool mask over ``g.edges``. ConfigError names an edge ``g`` lacks.
        """
        if isinstance(edges, torch.Tensor):
            mask = _check_mask(g, edges)
        else:
            if isinstance(edges, str):
                edges = [edges]
            mask = torch.zeros(g.n_edges, dtype=torch.bool)
            for e in edges:
                mask[g.edge_index(e)] = True
        fields.setdefault("model", g.model)
        c = cls(
            edges=[g.edges[i] for i in mask.nonzero().flatten().tolist()],
            heads=list(g.heads),
            kv_heads=list(g.kv_heads),
            parallel=list(g.parallel),
            n_graph_edges=g.n_edges,
            **fields,
        )
        c._graph = g
        return c

    # -- structure -------------------------------------------------------------------------------------------

    def graph(self) -> Graph:
        """The component graph the circuit lives in (rebuilt from :attr:`heads`, :attr:`kv_heads`, :attr:`parallel`)."""
        if self._graph is None:
            g = Graph(self.model, list(self.heads), list(self.kv_heads), list(self.parallel))
            if g.n_edges != self.n_graph_edges:
                raise InputError(
                    f"the circuit says its graph has {self.n_graph_edges} edges, but its layout "
                    f"({len(self.heads)} layers of {self.heads} heads) gives {g.n_edges}; the file is "
                    "damaged or was edited by hand"
                )
            self._graph = g
        return self._graph

    def mask(self, graph: Graph | None = None) -> torch.Tensor:
        """``(n_edges,)`` bool over ``graph.edges`` (default :meth:`graph`): True for the circuit's edges.

        InputError if ``graph`` is another layout (another model); ConfigError names an edge it lacks.
        """
        g = self.graph() if graph is None else graph
        if (list(g.heads), list(g.kv_heads), list(g.parallel)) != (
            list(self.heads),
            list(self.kv_heads),
            list(self.parallel),
        ):
            raise InputError(
                f"this circuit is of a model with heads {self.heads} (kv heads {self.kv_heads}) per "
                f"layer; the graph given has {g.heads} (kv {g.kv_heads}): use the model it was found on"
            )
        m = torch.zeros(g.n_edges, dtype=torch.bool)
        for e in self.edges:
            m[g.edge_index(e)] = True
        return m

    @property
    def n_edges(self) -> int:
        return len(self.edges)

    @property
    def nodes(self) -> list[str]:
        """The nodes on a path from ``input`` to ``logits`` through the circuit's edges, in the order the stream
        receives them (``input`` first, ``logits`` last); ``[]`` when no path exists."""
        g = self.graph()
        _, fwd, bwd = paths(g, self.mask(g))
        on = (fwd & bwd).nonzero().flatten().tolist()
        names = g.senders + ["logits"]
        return [names[i] for i in on]

    def prune(self) -> Circuit:
        """A new circuit of the edges on a path from the input to the logits (module docstring); the others
        (dangling: their sender is never reached from the input, or their receiver's nodes never reach the logits)
        are dropped, and a note says how many."""
        g = self.graph()
        before = self.mask(g)
        keep = on_paths(g, before)
        dropped = int(before.sum()) - int(keep.sum())
        notes = list(self.notes)
        if dropped:
            notes.append(
                f"pruned {dropped} of {int(before.sum())} edges that lie on no path from the input to the logits"
            )
        out = Circuit(
            model=self.model,
            edges=[g.edges[i] for i in keep.nonzero().flatten().tolist()],
            heads=list(self.heads),
            kv_heads=list(self.kv_heads),
            parallel=list(self.parallel),
            n_graph_edges=self.n_graph_edges,
            method=self.method,
            scores=dict(self.scores),
            ablation=self.ablation,
            metric=self.metric,
            clean=self.clean,
            corrupted=self.corrupted,
            empty=self.empty,
            circuit_metric=self.circuit_metric if not dropped else None,
            settings=dict(self.settings),
            seconds=self.seconds,
            notes=notes,
        )
        if dropped and self.circuit_metric is not None:
            out.notes.append(
                "circuit_metric was measured before pruning; measure the pruned circuit again "
                "(faithfulness(...)) for its own figure"
            )
        out._graph = g
        return out

    @property
    def faithfulness(self) -> float | None:
        """``(m(C) - m(empty)) / (m(full) - m(empty))`` with ``m(full)`` the clean run's metric: 1 = the circuit
        alone keeps the model's behaviour, 0 = no better than ablating everything (None: not measured)."""
        c, e, full = self.circuit_metric, self.empty, self.clean
        if c is None or e is None or full is None or full == e:
            return None
        return (c - e) / (full - e)

    # -- files -----------------------------------------------------------------------------------------------

    def to_result(self) -> Result:
        settings = {"method": self.method, "ablation": self.ablation, "metric": self.metric, **self.settings}
        figures = {
            "edges": self.edges,
            "n_edges": self.n_edges,
            "n_graph_edges": self.n_graph_edges,
            "nodes": self.nodes,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "parallel": self.parallel,
            "scores": {k: _num(v) for k, v in self.scores.items()},
            "clean": self.clean,
            "corrupted": self.corrupted,
            "empty": self.empty,
            "circuit_metric": self.circuit_metric,
            "faithfulness": self.faithfulness,
            "seconds": self.seconds,
            "notes": self.notes,
        }
        return Result(self.kind, model=self.model, settings=settings, figures=figures)

    def save(self, path: str | os.PathLike) -> Path:
        return self.to_result().save(path)

    @classmethod
    def from_result(cls, r: Result) -> Circuit:
        if r.kind != cls.kind:
            raise InputError(f"this file holds a {r.kind!r} result, not a circuit (headlab circuit discover ...)")
        f, s = r.figures, dict(r.settings)
        try:
            method, ablation, metric = s.pop("method"), s.pop("ablation", "patch"), s.pop("metric", "metric")
            return cls(
                model=r.model or "",
                edges=list(f["edges"]),
                heads=[int(h) for h in f["heads"]],
                kv_heads=[int(h) for h in f["kv_heads"]],
                parallel=[bool(p) for p in f["parallel"]],
                n_graph_edges=int(f["n_graph_edges"]),
                method=method,
                scores={k: float("nan") if v is None else float(v) for k, v in f.get("scores", {}).items()},
                ablation=ablation,
                metric=metric,
                clean=f.get("clean"),
                corrupted=f.get("corrupted"),
                empty=f.get("empty"),
                circuit_metric=f.get("circuit_metric"),
                settings=s,
                seconds=float(f.get("seconds", 0.0)),
                notes=list(f.get("notes", [])),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"this circuit file lacks or garbles {e}; write it again with Circuit.save") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> Circuit:
        return cls.from_result(Result.load(path, what="a circuit file headlab wrote"))

    # -- display ---------------------------------------------------------------------------------------------

    def _repr_html_(self) -> str:
        """The circuit's page (:mod:`headlab.interpret.circuits.page`), inline in a notebook."""
        from headlab.interpret.circuits.page import inline

        return inline(self)

    def __repr__(self) -> str:
        f = self.faithfulness
        return (
            f"Circuit({self.model}, {self.method}, {self.n_edges} of {self.n_graph_edges} edges, "
            f"{len(self.nodes)} nodes{'' if f is None else f', faithfulness {f:.3g}'})"
        )


def _num(v: float) -> float | None:
    return None if v != v else float(v)


__all__ = ["Circuit", "METHODS", "on_paths", "paths", "receiver_nodes"]
