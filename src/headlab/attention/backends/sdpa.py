"""``"sdpa"``: torch's fused :func:`torch.nn.functional.scaled_dot_product_attention`.

On the CPU torch runs its flash kernel (no n x n map) for every dtype when there is no dropout;
a mask function is materialised as a boolean mask first (n x n bytes), and dropout takes torch's
math path, which materialises the map: both are counted by the memory guard. Grouped-query
heads use ``enable_gqa``. Fully masked query rows come back as zeros. A call with a NaN or inf
in q, k or v takes torch's math kernel, which propagates them (the flash kernel zeroes the row).
``return_lse=True`` (and half-precision gradients with grouped heads) go through the flash op
that returns the log-sum-exp, with K/V expanded per query head; that op wants one head size, so a
value head dim that differs from the query/key one is met by zero-padding the smaller side (exact:
zero columns add nothing to a score, and the padded output columns are sliced off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from headlab.attention.backends.base import Backend, Capabilities, register
from headlab.costs.dense import sdpa_cost
from headlab.spec.attention_spec import AttentionSpec, dense_mask, mask_numel, materialized_bytes
from headlab.spec.masks import MaskFn
from headlab.spec.memory_guard import check_fits
from headlab.spec.visibility import additive_bias, is_additive


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
    if spec.mask_kind in ("function", "additive") or (spec.mask_kind == "bool" and spec.causal):
        total += mask_numel(spec)
    if materializes(spec):
        total += 2 * materialized_bytes(spec) + spec.weights_numel
    return total


def _finite(*ts) -> bool:
    # one reduction per tensor: a NaN or inf makes the sum non-finite (an overflowing sum of finite
    # values only sends the call to the math kernel, which gives the same numbers)
    return all(t is None or not t.is_floating_point() or bool(torch.isfinite(t.sum())) for t in ts)


@register
class SdpaBackend(Backend):
    name = "sdpa"
    summary = "torch.nn.functional.scaled_dot_product_attention (fused; flash kernel on CPU)"
    capabilities = Capabilities(returns_weights=False, materializes=False)
    priority = 0
    alternative = "reference"
    cost = staticmethod(sdpa_cost)

    def working_set_bytes(self, spec: AttentionSpec) -> int:
        return working_set_bytes(spec)

    def materializes(self, spec: AttentionSpec) -> bool:
        return materializes(spec)

    def supports(self, spec: AttentionSpec) -> tuple[bool, str]:
        if spec.need_lse and spec.dropout_p > 0:
            return False, "returning the log-sum-exp with dropout is not supported"
        return super().supports(spec)

    def check_memory(self, spec: AttentionSpec) -> None:
        if materializes(spec) or spec.mask_kind in ("function", "additive"):
            check_fits(
                working_set_bytes(spec),
                what=f"backend 'sdpa' at {spec.q_len}x{spec.kv_len}",
                device=spec.device,
                alternative="tiled",
            )

    def forward(self, q, k, v, spec, *, mask, scale, score_mod=None):
        attn_mask = None
        if isinstance(mask, MaskFn) or (spec.causal and mask is not None):
            # one mask for the kernel: the combined visibility (a float mask keeps its values)
            attn_mask = additive_bias(spec, mask, dtype=q.dtype) if is_additive(mask) else dense_mask(spec, mask)
        elif mask is not None:
            attn_mask = mask.to(q.dtype) if is_additive(mask) else mask
        is_causal = spec.causal and attn_mask is None
        if not _finite(q, k, v):
            # torch's flash kernel turns a row with a NaN score into zeros: the policy is that
            # non-finite values propagate, so such calls take torch's math kernel (as in torch)
            with sdpa_kernel(SDPBackend.MATH):
                out = _call(q, k, v, attn_mask, spec, is_causal, scale, spec.dropout_p)
            return _zero_dead(out, attn_mask), None, None
        if spec.need_lse or (
            spec.requires_grad and spec.group > 1 and spec.dropout_p == 0 and q.dtype in (torch.float16, torch.bfloat16)
        ):
            out, lse = _flash_with_lse(q, k, v, attn_mask, spec, is_causal, scale)
            return out, None, lse
        out = _call(q, k, v, attn_mask, spec, is_causal, scale, spec.dropout_p)
        if attn_mask is not None and spec.dropout_p > 0:
            out = _zero_dead(out, attn_mask)  # torch's math path (taken with dropout) gives NaN there
        return out, None, None


def _call(q, k, v, attn_mask, spec, is_causal, scale, dropout_p):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=spec.group > 1
    )


def _dead_rows(attn_mask) -> torch.Tensor | None:
    if attn_mask is None:
        return None
    vis = attn_mask if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask)
    return ~vis.any(dim=-1, keepdim=True)  # (B?, H?, Lq, 1)


def _zero_dead(out, attn_mask):
    dead = _dead_rows(attn_mask)
    return out if dead is None else out.masked_fill(dead, 0.0)


def _flash_with_lse(q, k, v, attn_mask, spec, is_causal, scale):
    """The flash kernel through the op that also returns the log-sum-exp (natural log). K/V are
    expanded per query head (the op has no grouped heads) in float32 for half precision, so the
    gradient's sum over a query group is accumulated in float32 and rounded once (torch's own
    grouped backward sums it in half precision: 4x the plain float16 error on dk)."""
    G = spec.group
    half = q.dtype in (torch.float16, torch.bfloat16)
    if G > 1:
        wide = torch.float32 if half else q.dtype
        k = k.to(wide).repeat_interleave(G, dim=1).to(q.dtype)  # (B, H, Lk, D); backward sums in wide
        v = v.to(wide).repeat_interleave(G, dim=1).to(q.dtype)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    if q.device.type == "cpu":
        q, k, v, v_dim = _common_head_dim(q, k, v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale
        )
        out = out[..., :v_dim]
    else:
        out, lse = _cuda_with_lse(q, k, v, attn_mask, is_causal, scale)
    lse = lse.float() if half else lse
    dead = _dead_rows(attn_mask)
    if dead is not None:
        out = out.masked_fill(dead, 0.0)
        lse = lse.masked_fill(dead.squeeze(-1).expand_as(lse), float("-inf"))
    return out, lse


def _common_head_dim(q, k, v):
    """torch's CPU flash op wants one head size for q, k and v. Zero columns change nothing:
    padding q and k adds ``0 * 0`` to every score (the scale is passed explicitly), padding v adds
    output columns that are sliced off. Returns the padded q, k, v and the true value head dim."""
    D, Dv = q.shape[-1], v.shape[-1]
    if D < Dv:
        q, k = F.pad(q, (0, Dv - D)), F.pad(k, (0, Dv - D))
    elif Dv < D:
        v = F.pad(v, (0, D - Dv))
    return q, k, v, Dv


def _cuda_with_lse(q, k, v, attn_mask, is_causal, scale):
    """Off the CPU: the output from the fused kernel, the log-sum-exp from one more pass of
    scores (no autograd through it: it is returned as a non-differentiable statistic)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    with torch.no_grad():
        s = (q.float() @ k.float().transpose(-1, -2)) * scale
        if attn_mask is not None:
            s = s + attn_mask.float()
        if is_causal:
            s = s.masked_fill(
                torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril_().logical_not_(), float("-inf")
            )
        lse = torch.logsumexp(s, -1)
    return out, lse
