"""``"reference"``: the equations, materialised. The oracle every other backend is tested against.

    S = Q K^T * scale           (B, H, Lq, Lk)   one n x n buffer
    S[~mask] = -inf             in place
    P = softmax(S, -1)          (B, H, Lq, Lk)   a second n x n buffer; S is freed
    O = P V                     (B, H, Lq, Dv)

Grouped-query heads are computed without copying K/V: the G query heads that share a kv head
are stacked along the sequence axis, ``(B, Hkv, G*Lq, D) @ (B, Hkv, D, Lk)``.
A query row that sees no key outputs zeros (its weights are zeros too).
Works in any floating dtype, float64 included; it computes in the input dtype, so a float16
call is the "plain implementation in the same precision" of the FlashAttention error rule.
"""

from __future__ import annotations

import torch

from headlab.attention.backends.base import Backend, Capabilities, register
from headlab.attention.guard import check_fits
from headlab.attention.spec import AttentionSpec, dense_mask, mask_numel, materialized_bytes


def working_set_bytes(spec: AttentionSpec) -> int:
    """Peak extra bytes of one forward call: scores and probabilities (two n x n buffers in the
    input dtype), the boolean mask and its complement, a dropout copy, a weights copy."""
    n2 = materialized_bytes(spec)
    total = 2 * n2
    m = mask_numel(spec)
    if m:
        total += 2 * m  # the mask (bool) and its complement for masked_fill
    if spec.dropout_p > 0:
        total += n2 + spec.weights_numel  # dropped probabilities and the keep mask
    if spec.need_weights and m:
        total += n2  # weights with fully masked rows zeroed
    return total


@register
class ReferenceBackend(Backend):
    name = "reference"
    summary = "plain materialised softmax(QK^T)V; any dtype incl. float64; the oracle"
    capabilities = Capabilities(returns_weights=True, materializes=True)
    priority = 1000
    alternative = "sdpa"

    def check_memory(self, spec: AttentionSpec) -> None:
        check_fits(working_set_bytes(spec), what=f"backend 'reference' at {spec.q_len}x{spec.kv_len} "
                   f"({spec.batch}x{spec.heads} maps, {str(spec.dtype).removeprefix('torch.')})",
                   device=spec.device, alternative=_alternative(spec))

    def forward(self, q, k, v, spec, *, mask, scale):
        B, H, Lq, D = q.shape
        Hkv, Lk, Dv, G = spec.kv_heads, spec.kv_len, spec.v_dim, spec.group
        qg = q.reshape(B, Hkv, G * Lq, D)  # (B, Hkv, G*Lq, D): heads sharing a kv head stacked
        s = torch.matmul(qg, k.transpose(-1, -2)).view(B, H, Lq, Lk)  # (B, H, Lq, Lk)
        s.mul_(scale)  # in place: matmul saves its inputs, not its output
        visible = dense_mask(spec, mask)
        dead = None
        if visible is not None:
            s = s.masked_fill(~visible, float("-inf"))
            dead = ~visible.any(dim=-1, keepdim=True)  # (B?, H?, Lq, 1): rows that see no key
            if bool(dead.any()):
                s = s.masked_fill(dead, 0.0)  # finite row; its output is zeroed below
            else:
                dead = None
        p = torch.softmax(s, dim=-1)  # (B, H, Lq, Lk)
        del s
        weights = p
        if spec.dropout_p > 0:
            p = torch.nn.functional.dropout(p, spec.dropout_p, training=True)
        out = torch.matmul(p.view(B, Hkv, G * Lq, Lk), v).view(B, H, Lq, Dv)  # (B, H, Lq, Dv)
        if dead is not None:
            out = out.masked_fill(dead, 0.0)
            if spec.need_weights:
                weights = weights.masked_fill(dead, 0.0)
        return out, (weights if spec.need_weights else None)


def _alternative(spec: AttentionSpec) -> str:
    from headlab.attention.backends import base

    for name in ("sdpa", "tiled"):
        if name in base.names():
            b = base.get(name)
            if b.supports(spec.with_(need_weights=False))[0]:
                return name
    return "sdpa"
