"""The pattern scores of the atlas, each its paper's definition, computed without an ``n x n`` map.

Every score here is a mean of ``A[i, j]`` over chosen pairs (query i, key j) of one head's attention
map ``A`` ``(Lq, Lk)``. None of them needs the map: with ``lse_i = log sum_j exp(S_ij)`` (the
log-normaliser of row i) and the same quantity ``lse_i(K)`` over a chosen key set ``K`` alone,

    sum_{j in K} A[i, j] = exp(lse_i(K) - lse_i)                                        (1)

and both log-normalisers come from :func:`headlab.attention_stats` (``stats=["lse"]``) on the layer's
own queries and keys (captured at ``blocks.L.attn.q`` / ``.k``, after rotary embeddings), with the
model's own mask, scale and score modification (ALiBi, soft-capping: the capture's ``call_args``) and
one more mask that keeps ``K``: ``kv == q - offset`` for a diagonal, a window for the local mass,
the first token for the sink. Memory is linear in the sequence length, as in FlashAttention.

Each kind's module under ``kinds/`` names the pairs it means over and calls the functions here.

``copying`` (:func:`ov_copying`) is Olsson et al.'s OV-circuit copying score: the eigenvalues
``lambda`` of the full OV circuit ``W_E W_V^h W_O^h W_U`` (vocab x vocab, embeddings as rows), as
``sum(lambda) / sum(|lambda|)`` (1: the head raises the logit of the token it attends to; -1: it
lowers it). Its non-zero eigenvalues are those of the ``d x d`` matrix ``W_O^h (W_U W_E) W_V^h``, so
no vocab x vocab matrix is formed. Layer norms and biases are left out, as in the paper.

Example: a previous-token head's score is its mean weight one step back.

    >>> import torch
    >>> from headlab.interpret.atlas.scores import offset_mass
    >>> q = torch.zeros(1, 1, 4, 2); k = torch.zeros(1, 1, 4, 2)     # uniform causal rows
    >>> offset_mass(q, k, {"mask": None, "causal": True, "scale": 1.0}, 1)[0, 0]
    tensor([0.0000, 0.5000, 0.3333, 0.2500])
"""

from __future__ import annotations

import torch
from torch import nn

from headlab.attention.stats import attention_stats
from headlab.errors import ConfigError, ModelError
from headlab.spec import masks


def _lse(q: torch.Tensor, k: torch.Tensor, call_args: dict, keep=None) -> torch.Tensor:
    """``(B, H, Lq)`` log-normalisers of the layer's rows, over the keys ``keep`` lets through (a mask
    function, or None for every key the model's own mask allows)."""
    args = dict(call_args)
    mask, causal, scale = args.pop("mask", None), bool(args.pop("causal", False)), args.pop("scale", None)
    if keep is not None:
        if mask is None:
            mask = keep
        elif isinstance(mask, torch.Tensor):
            if mask.dtype != torch.bool:
                raise ConfigError(
                    f"the model's own mask is a {mask.dtype} tensor; the atlas reads boolean masks and mask functions"
                )
            mask = mask & keep.dense(q_len=q.shape[2], kv_len=k.shape[2]).to(mask.device)
        else:
            mask = masks.as_mask(mask) & keep
    st = attention_stats(
        q.float().contiguous(), k.float().contiguous(), mask=mask, causal=causal, scale=scale, stats=["lse"], **args
    )
    assert st.lse is not None  # asked for
    return st.lse


def row_mass(q: torch.Tensor, k: torch.Tensor, call_args: dict, keep, full: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, H, Lq)``: the weight each row puts on the keys ``keep`` lets through, by identity (1).

    ``q`` ``(B, H, Lq, d)``, ``k`` ``(B, Hkv, Lk, d)`` as the capture recorded them; ``call_args`` the
    layer's entry of ``cache.call_args``; ``keep`` a mask function (:mod:`headlab.masks`); ``full`` the
    rows' log-normalisers when known (the captured statistics' ``lse``). A row that sees none of those
    keys gets 0."""
    full = _lse(q, k, call_args) if full is None else full.to(torch.float32)
    part = _lse(q, k, call_args, keep)
    out = torch.exp(part - full)
    return torch.where(torch.isfinite(full), out, torch.zeros_like(out))


def offset_mass(q, k, call_args: dict, offset: int, full=None) -> torch.Tensor:
    """``(B, H, Lq)``: ``A[i, i - offset]`` for every row (0 where that key does not exist)."""
    off = int(offset)
    return row_mass(q, k, call_args, masks.as_mask(lambda b, h, qi, kv: qi - kv == off), full)


def window_mass(q, k, call_args: dict, window: int, *, causal: bool, full=None) -> torch.Tensor:
    """``(B, H, Lq)``: the weight on keys within ``window`` positions (``0 <= i - j < window`` causal,
    else ``|i - j| < window``)."""
    if not isinstance(window, int) or window < 2:
        raise ConfigError(f"the local window must be an integer of at least 2 keys, got {window!r}")
    return row_mass(q, k, call_args, masks.sliding_window(window - 1, causal=causal), full)


def position_mass(q, k, call_args: dict, positions: torch.Tensor) -> torch.Tensor:
    """``(B, H, Lq)``: the weight on the keys flagged in ``positions`` ``(B, Lk)`` bool (the sinks)."""
    flags = positions.bool()
    return row_mass(q, k, call_args, masks.as_mask(lambda b, h, qi, kv: flags[b, kv]))


def embeddings(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(W_E (V, E), W_U (E, V), tied)``: the token embedding and the unembedding (the embedding's
    transpose when the model has no output head of its own, as in a sentence encoder)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else getattr(model, "tok_emb", None)
    if not isinstance(emb, nn.Embedding):
        raise ModelError(
            f"cannot find the token embedding of {type(model).__name__} (get_input_embeddings() or "
            "tok_emb); the copying score needs one"
        )
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    w_e = emb.weight.detach()
    if isinstance(out, nn.Linear) and out.weight.shape == w_e.shape:
        return w_e, out.weight.detach().T, out.weight is emb.weight
    return w_e, w_e.T, True


def ov_copying(adapter) -> torch.Tensor:
    """``(n_layers, H)``: Olsson et al.'s copying score ``sum(lambda) / sum(|lambda|)`` of each head's
    OV circuit (see the module docstring); NaN for heads a pruned layer no longer has.

    On a model sharded by tensor parallelism the weights are read whole (``placement.full``: a collective, every
    rank alike), each rank takes the eigenvalues of the heads it holds and the grid is added over its tensor-parallel
    group (``placement.sum_group``)."""
    place = adapter.placement
    full = place.full
    w_e, w_u, _ = embeddings(adapter.model)
    g = full(w_u).double() @ full(w_e).double()  # (E, E): embed a token, then read its logit back
    out = torch.full((adapter.n_layers, adapter.n_heads), 0.0 if place.sharded else float("nan"))
    for layer in range(adapter.n_layers):
        wv = full(adapter.W_V(layer).detach()).double()  # (Hkv, E, d)
        wo = full(adapter.W_O(layer).detach()).double()  # (H, d, E)
        H, Hkv = wo.shape[0], wv.shape[0]
        for h in place.heads() if place.sharded else range(H):
            m = wo[h] @ g @ wv[h // (H // Hkv)]  # (d, d) = W_O (W_U W_E) W_V
            lam = torch.linalg.eigvals(m)
            den = float(lam.abs().sum())
            out[layer, h] = float(lam.sum().real) / den if den > 0 else 0.0
    return place.sum_group(out)  # sharded: each head from its owner, zeros elsewhere


__all__ = ["embeddings", "offset_mass", "ov_copying", "position_mass", "row_mass", "window_mass"]
