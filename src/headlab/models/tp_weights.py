"""Weights read whole on a model sharded by tensor parallelism: per-head W_V, b_V and W^O in global head order, and
the unembedding (:func:`readout`) as one tensor.

Under transformers' plan each rank holds its heads' rows of v_proj and its heads' columns of o_proj, as
``DTensor`` shards (:mod:`headlab.models.tensor_parallel`); the adapter's ``W_V(l)``, ``b_V(l)`` and ``W_O(l)``
are then views of those DTensors, which plain tensors (a recorded stream) cannot be multiplied with. The readers
that need the value path of every head (the value-aware norms, the norm-based rollout, the analyze page's flow
part) take the **full** weights here, gathered once per layer (``DTensor.full_tensor()``: an all-gather on the
mesh, shards concatenated in rank order, which is global head order since
:func:`~headlab.models.tensor_parallel.placement_of` checked each shard's offset).

Why gather the weights rather than compute each head's value path ``f_h(x_j) = (x_j W_V + b_V) W_O^h`` on its
owning rank and gather the results: the layer norm map needs the Gram matrix ``<f_h(x_j), f_h'(x_j)>`` between
heads that live on different ranks, so the vectors themselves (``H x n x E`` numbers per layer, growing with the
input) would have to move; one layer's W_V and W^O (``(Hkv + H) d E`` numbers, fixed) are smaller as soon as the
input is longer than about ``2 d`` tokens, and then every rank computes exactly what one process computes, in the
same order of operations, so the figures agree to rounding. The cost is one layer's value and output weights held
whole for the duration of one layer's computation (then freed), never the whole model's.

The unembedding: transformers' plans cut ``lm_head`` by vocabulary rows (``colwise_gather_output``: the logits
are gathered after it). :func:`readout` reads the model's final norm and unembedding
(:func:`~headlab.models.readout.readout_of`, whose check runs the model and compares its logits) with the
unembedding gathered whole, so the logit lens and direct logit attribution read ``W_U[token]`` for any token on
every rank; it costs one ``V x E`` matrix per rank, the size of the gathered logits of ``E`` positions.

Every rank must call these alike (the gathers are collectives); on a model that is not sharded they return the
adapter's own views, detached, and move nothing.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from headlab.distributed.placement import Placement
from headlab.models.readout import Readout, readout_of


def value_path(adapter, layer: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(W_V (Hkv, E, d), b_V (Hkv, d) or None, W_O (H, d, E))`` of ``layer``, detached, every head in global
    order on every rank: what head h's transformed value ``f_h(x) = (x W_V[kv(h)] + b_V[kv(h)]) W_O[h]`` needs.

        >>> from headlab.models import adapt
        >>> from headlab.models.transformer import Transformer, TransformerConfig
        >>> a = adapt(Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4)))
        >>> [tuple(t.shape) for t in value_path(a, 0) if t is not None]
        [(4, 32, 8), (4, 8), (4, 8, 32)]
    """
    full = adapter.placement.full
    WV = full(adapter.W_V(layer).detach())
    bV = adapter.b_V(layer)
    bV = None if bV is None else full(bV.detach())
    WO = full(adapter.W_O(layer).detach())
    return WV, bV, WO


@overload
def whole(t: torch.Tensor) -> torch.Tensor: ...
@overload
def whole(t: None) -> None: ...
def whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as one plain tensor on every rank (a sharded weight gathered, detached), None as None."""
    return None if t is None else Placement.full(t.detach())


def readout(adapter) -> Readout:
    """:func:`~headlab.models.readout.readout_of` with ``W_U`` (and ``b_U``) whole on every rank of a sharded model
    (cached on the adapter, as ``readout_of`` caches); on a model that is not sharded, ``readout_of`` itself.

    ``readout_of`` reads the unembedding from ``get_output_embeddings()``; on a sharded model it is handed, for
    the one call, a plain ``nn.Linear`` holding the gathered weight, while the model's own (sharded) ``lm_head``
    still computes the logits its check compares with."""
    if not adapter.placement.sharded:
        return readout_of(adapter)
    cached = getattr(adapter, "_headlab_readout", None)
    if cached is not None:
        return cached
    model = adapter.model
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        return readout_of(adapter)  # its refusal says what is missing
    W = whole(head.weight)  # (V, E): an all-gather of the vocabulary rows
    b = getattr(head, "bias", None)
    proxy = nn.Linear(W.shape[1], W.shape[0], bias=b is not None, device=W.device, dtype=W.dtype)
    with torch.no_grad():
        proxy.weight.copy_(W)
        if b is not None:
            proxy.bias.copy_(whole(b))
    model.get_output_embeddings = lambda: proxy  # this instance only, for this call
    try:
        return readout_of(adapter)
    finally:
        del model.get_output_embeddings


__all__ = ["readout", "value_path", "whole"]
