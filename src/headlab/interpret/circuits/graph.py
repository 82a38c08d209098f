"""The component graph of a served model: nodes, edges and their names (Hanna et al. 2024's convention).

A decoder's residual stream is a sum: the input embedding, every attention head's share of W^O's output
(``head_out``, its bias a constant), every MLP's output. Each component reads the stream as it stands when it
runs, so a *sender* (a node that writes to the stream) reaches every *receiver* (a node's input) downstream::

    senders     input   a{l}.h{h}  (head h of layer l: z_h @ W_O[h])   m{l}  (the MLP of block l)
    receivers   a{l}.h{h}<q>   a{l}.h{g}<k>   a{l}.h{g}<v>   m{l}   logits

A head's query, key and value inputs are separate receivers (the same stream, read through the block's norm
into W_Q, W_K, W_V); on a grouped-query model ``k`` and ``v`` receivers are per *kv head* ``g`` (a kv head is
one input, shared by its ``H / Hkv`` query heads). Edges are named ``sender->receiver``: ``input->a0.h1<q>``,
``a0.h1->a3.h2<k>``, ``m2->m5``, ``a29.h1->logits``, so circuits compare with the EAP-IG code's.

Which senders reach a receiver (``upstream``): heads of layer ``l`` read the stream entering block ``l``
(the input, every head and MLP of the layers below); the MLP of a *sequential* block also reads its own
layer's heads; the MLP of a *parallel* block (GPT-J, GPT-NeoX, Phi, Falcon) reads what its heads read; the
logits read everything. So with ``N_l`` = ``H_l`` heads + 1 MLP per layer and ``R_l = H_l + 2 Hkv_l``
attention receivers per layer::

    edges = sum_l R_l * (1 + sum_{l' < l} N_l')  +  sum_l (1 + sum_{l' < l} N_l' + [sequential] H_l)
            + (1 + sum_l N_l)

:func:`graph` builds it from a served model and refuses, typed, a model whose stream is not that sum (post-norm
encoders such as BERT add the attention's output inside a norm; Gemma 2's sandwich norms rescale each branch).

    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> g = graph(Transformer(TransformerConfig(n_layers=2, n_heads=4, n_kv_heads=2, causal=True)))
    >>> g.n_nodes, g.n_edges
    (12, 82)
    >>> g.edges[0], g.edges[-1]
    ('input->a0.h0<q>', 'm1->logits')
"""

from __future__ import annotations

from dataclasses import dataclass, field

from headlab.errors import ConfigError, UnsupportedArchitectureError
from headlab.models.loader import resolve


def head(layer: int, h: int) -> str:
    return f"a{layer}.h{h}"


def mlp(layer: int) -> str:
    return f"m{layer}"


@dataclass(frozen=True)
class Receiver:
    """One node input: ``kind`` is ``"q"``, ``"k"``, ``"v"`` (head ``index`` of layer ``layer``; k and v index kv
    heads), ``"mlp"`` or ``"logits"`` (``layer`` is ``n_layers`` for the logits)."""

    kind: str
    layer: int
    index: int = 0

    @property
    def name(self) -> str:
        if self.kind == "logits":
            return "logits"
        if self.kind == "mlp":
            return mlp(self.layer)
        return f"{head(self.layer, self.index)}<{self.kind}>"


@dataclass
class Graph:
    """Senders, receivers and edges of one model (see the module docstring).

    Attributes:
        heads, kv_heads: per layer. parallel: per layer, whether the MLP reads the block's input beside the
        attention (True) or the stream after it (False).
        senders: names in the order the stream receives them (``input``, then per layer its heads and its MLP).
        receivers: :class:`Receiver` per node input, in the order they read the stream.
        edges: ``"sender->receiver"`` names, receiver by receiver in that order, senders in order within.
        offsets: per receiver, the index of its first edge in :attr:`edges`.
    """

    model: str
    heads: list[int]
    kv_heads: list[int]
    parallel: list[bool]
    senders: list[str] = field(default_factory=list)
    receivers: list[Receiver] = field(default_factory=list)
    edges: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.senders = ["input"]
        for l, H in enumerate(self.heads):
            self.senders += [head(l, h) for h in range(H)] + [mlp(l)]
        self.receivers = []
        for l, (H, G) in enumerate(zip(self.heads, self.kv_heads)):
            self.receivers += [Receiver("q", l, h) for h in range(H)]
            self.receivers += [Receiver(k, l, g) for k in ("k", "v") for g in range(G)]
            self.receivers.append(Receiver("mlp", l))
        self.receivers.append(Receiver("logits", self.n_layers))
        self._index = {s: i for i, s in enumerate(self.senders)}
        self._start = [1 + sum(h + 1 for h in self.heads[:l]) for l in range(self.n_layers + 1)]  # block l's first
        self.edges = [f"{s}->{r.name}" for r in self.receivers for s in self.upstream(r)]
        self.offsets = []  # receiver i's edges are edges[offsets[i] : offsets[i] + n_upstream(receivers[i])]
        off = 0
        for r in self.receivers:
            self.offsets.append(off)
            off += self.n_upstream(r)
        self._edge_index = {e: i for i, e in enumerate(self.edges)}

    @property
    def n_layers(self) -> int:
        return len(self.heads)

    @property
    def n_nodes(self) -> int:
        """input + heads + MLPs + logits."""
        return len(self.senders) + 1

    @property
    def n_edges(self) -> int:
        return len(self.edges)

    def n_upstream(self, r: Receiver) -> int:
        """How many senders reach ``r``: the first ``n_upstream(r)`` of :attr:`senders`."""
        if r.kind == "logits":
            return len(self.senders)
        if r.kind == "mlp" and not self.parallel[r.layer]:
            return self._start[r.layer] + self.heads[r.layer]
        return self._start[r.layer]

    def upstream(self, r: Receiver) -> list[str]:
        return self.senders[: self.n_upstream(r)]

    def sender_index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ConfigError(
                f"{name!r} is not a sender of this graph: give 'input', 'a{{layer}}.h{{head}}' or "
                f"'m{{layer}}' ({self.n_layers} layers of {max(self.heads, default=0)} heads)"
            ) from None

    def edge_index(self, name: str) -> int:
        try:
            return self._edge_index[name]
        except KeyError:
            raise ConfigError(
                f"{name!r} is not an edge of this graph ({self.n_edges} edges, named like "
                f"{self.edges[0]!r}); a sender reaches only receivers downstream of it"
            ) from None

    def parse(self, edge: str) -> tuple[int, Receiver]:
        """``(sender index, receiver)`` of an edge name."""
        self.edge_index(edge)
        s, r = edge.split("->")
        return self._index[s], self._receiver(r)

    def _receiver(self, name: str) -> Receiver:
        if not hasattr(self, "_receivers_by_name"):
            self._receivers_by_name = {r.name: r for r in self.receivers}
        return self._receivers_by_name[name]

    def receiver(self, name: str) -> Receiver:
        try:
            return self._receiver(name)
        except KeyError:
            raise ConfigError(
                f"{name!r} is not a receiver: give 'a{{l}}.h{{h}}<q|k|v>', 'm{{l}}' or 'logits'"
            ) from None

    def formula(self) -> int:
        """The edge count from the closed form in the module docstring (a check on :attr:`edges`)."""
        n = [h + 1 for h in self.heads]
        total = 0
        for l in range(self.n_layers):
            up = 1 + sum(n[:l])
            total += (self.heads[l] + 2 * self.kv_heads[l]) * up
            total += up + (0 if self.parallel[l] else self.heads[l])
        return total + 1 + sum(n)

    def __repr__(self) -> str:
        return (
            f"Graph({self.model}: {self.n_layers} layers, {self.n_nodes} nodes, {self.n_edges} edges, "
            f"{len(self.receivers)} receivers)"
        )


def check_stream(adapter) -> list[bool]:
    """Per layer, whether its MLP runs in parallel; refuses (typed) a model whose stream is not a sum of nodes."""
    family = getattr(adapter, "family", type(adapter.model).__name__)
    if set(adapter.stacks) != {"blocks"} or adapter.shared_layers:
        raise UnsupportedArchitectureError(
            f"circuits need one stack of unshared blocks; the {family!r} model has stacks {', '.join(adapter.stacks)}"
            f"{' and shares blocks across layers' if adapter.shared_layers else ''}"
        )
    if adapter.placement.sharded:
        raise UnsupportedArchitectureError(
            "circuits run on one process: the model is sharded by tensor parallelism; "
            "load it without --tensor-parallel (the graph splits pairs, not heads)"
        )
    parallel = []
    for l in range(adapter.n_layers):
        norms = adapter.attention_norm(l)
        if norms.post is not None:
            raise UnsupportedArchitectureError(
                f"the {family!r} model normalises after attention ({norms.layout}-norm blocks): its residual stream "
                "is not the sum of its heads' and MLPs' outputs, so edges between them are not defined; circuits "
                "take pre-norm models (GPT-2, Llama, Qwen, Mistral, Gemma 1, OLMo, ...) and parallel blocks"
            )
        if norms.branch_scale is not None:
            raise UnsupportedArchitectureError(
                f"the {family!r} model scales its attention branch before the residual add (LayerScale or a residual "
                "multiplier): a head adds a scaled head_out to the stream, which the circuit graph does not model"
            )
        adapter.mlp(l)  # UnsupportedArchitectureError: no MLP module on the stream alone
        parallel.append(norms.parallel is not None)
    return parallel


def graph(model) -> Graph:
    """The component graph of ``model`` (a LoadedModel, an ``nn.Module`` of a served family, or an adapter)."""
    adapter, loaded = resolve(model)
    parallel = check_stream(adapter)
    name = getattr(loaded, "name", None) or type(adapter.model).__name__
    return Graph(name, list(adapter.layer_heads), list(adapter.layer_kv_heads), parallel)


__all__ = ["Graph", "Receiver", "check_stream", "graph", "head", "mlp"]
