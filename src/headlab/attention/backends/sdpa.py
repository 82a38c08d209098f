"""``"sdpa"``: torch's fused :func:`torch.nn.functional.scaled_dot_product_attention`.

On the CPU torch runs its flash kernel (no n x n map) for every dtype when there is no dropout;
a mask function is materialised as a boolean mask first (n x n bytes), and dropout takes torch's
math path, which materialises the map: both are counted by the memory guard. Grouped-query
heads use ``enable_gqa``. Fully masked query rows come back as zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headlab.attention.backends.base import Backend, Capabilities, register
from headlab.attention.guard import check_fits
from headlab.attention.masks import MaskFn
from headlab.attention.spec import AttentionSpec, mask_numel, materialized_bytes


def materializes(spec: AttentionSpec) -> bool:
    """Whether torch will take its math path (which holds the n x n map) for this call."""
    return spec.dropout_p > 0


def working_set_bytes(spec: AttentionSpec, block_q: int = 64, block_k: int = 512, threads: int | None = None) -> int:
    """Peak extra bytes: per-thread score tiles of the flash kernel, the dense mask if one is
    built, and two n x n buffers when torch falls back to its math path."""
    threads = threads or torch.get_num_threads()
    acc = 4  # the CPU kernel accumulates in float32
    tiles = threads * block_q * (2 * block_k + spec.v_dim) * acc
    lse = spec.batch * spec.heads * spec.q_len * acc
    total = tiles + lse
    if spec.mask_kind == "function" or (spec.mask_kind == "bool" and spec.causal):
        total += mask_numel(spec)
    if materializes(spec):
        total += 2 * materialized_bytes(spec) + spec.weights_numel
    return total


@register
class SdpaBackend(Backend):
    name = "sdpa"
    summary = "torch.nn.functional.scaled_dot_product_attention (fused; flash kernel on CPU)"
    capabilities = Capabilities(returns_weights=False, materializes=False)
    priority = 0
    alternative = "reference"

    def check_memory(self, spec: AttentionSpec) -> None:
        if materializes(spec) or spec.mask_kind == "function":
            check_fits(working_set_bytes(spec), what=f"backend 'sdpa' at {spec.q_len}x{spec.kv_len}",
                       device=spec.device, alternative="tiled")

    def forward(self, q, k, v, spec, *, mask, scale):
        attn_mask = None
        is_causal = spec.causal
        if isinstance(mask, MaskFn):
            attn_mask = mask.dense(spec.batch, spec.heads, spec.q_len, spec.kv_len, device=spec.device)
        elif mask is not None:
            attn_mask = mask
        if attn_mask is not None and is_causal:
            tri = torch.ones(spec.q_len, spec.kv_len, dtype=torch.bool, device=spec.device).tril_()
            attn_mask = attn_mask & tri
            is_causal = False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=spec.dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=spec.group > 1,
        )
        if attn_mask is not None and spec.dropout_p > 0:
            # torch's math path (taken with dropout) returns NaN for rows that see no key
            dead = ~attn_mask.any(dim=-1, keepdim=True)
            out = out.masked_fill(dead, 0.0)
        return out, None
