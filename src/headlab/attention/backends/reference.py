"""``"reference"``: the equations, materialised. The oracle every other backend is tested against.

    S = Q K^T * scale           (B, H, Lq, Lk)   one n x n buffer
    S[~mask] = -inf             in place
    P = softmax(S, -1)          (B, H, Lq, Lk)   a second n x n buffer; S is freed
    O = P V                     (B, H, Lq, Dv)

Grouped-query heads are computed without copying K/V: the G query heads that share a kv head
are stacked along the sequence axis, ``(B, Hkv, G*Lq, D) @ (B, Hkv, D, Lk)``.
A query row that sees no key outputs zeros (its weights are zeros too); NaN propagates (a NaN in
``q_i`` makes row ``i`` NaN). An additive float mask is added to the scaled scores; a score_mod
(FlexAttention's) is applied before the mask.
Works in any floating dtype, float64 included; it computes in the input dtype, so a float16
call is the "plain implementation in the same precision" of the FlashAttention error rule.
"""

from __future__ import annotations

import torch

from headlab.attention.backends.base import Backend, Capabilities, get, names, register
from headlab.costs.dense import reference_cost
from headlab.spec.attention_spec import AttentionSpec, dense_mask, mask_numel, materialized_bytes
from headlab.spec.memory_guard import check_fits
from headlab.spec.visibility import additive_bias, is_additive


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
    capabilities = Capabilities(returns_weights=True, materializes=True, score_mod=True)
    priority = 1000
    alternative = "sdpa"
    cost = staticmethod(reference_cost)

    def working_set_bytes(self, spec: AttentionSpec) -> int:
        return working_set_bytes(spec)

    def check_memory(self, spec: AttentionSpec) -> None:
        check_fits(
            working_set_bytes(spec),
            what=f"backend 'reference' at {spec.q_len}x{spec.kv_len} "
            f"({spec.batch}x{spec.heads} maps, {str(spec.dtype).removeprefix('torch.')})",
            device=spec.device,
            alternative=_alternative(spec),
        )

    def forward(self, q, k, v, spec, *, mask, scale, score_mod=None):
        B, H, Lq, D = q.shape
        Hkv, Lk, Dv, G = spec.kv_heads, spec.kv_len, spec.v_dim, spec.group
        qg = q.reshape(B, Hkv, G * Lq, D)  # (B, Hkv, G*Lq, D): heads sharing a kv head stacked
        s = torch.matmul(qg, k.transpose(-1, -2)).view(B, H, Lq, Lk)  # (B, H, Lq, Lk)
        s.mul_(scale)  # in place: matmul saves its inputs, not its output
        if score_mod is not None:
            dev = s.device
            s = score_mod(
                s,
                torch.arange(B, device=dev).view(B, 1, 1, 1),
                torch.arange(H, device=dev).view(1, H, 1, 1),
                torch.arange(Lq, device=dev).view(1, 1, Lq, 1),
                torch.arange(Lk, device=dev).view(1, 1, 1, Lk),
            )
        if is_additive(mask):
            s = s + additive_bias(spec, mask, dtype=s.dtype)  # float mask and causal, -inf = hidden
            dead = torch.isneginf(s).all(-1, keepdim=True)  # (B, H, Lq, 1): rows that see no key
        else:
            visible = dense_mask(spec, mask)
            dead = None
            if visible is not None:
                s = s.masked_fill(~visible, float("-inf"))
                dead = ~visible.any(dim=-1, keepdim=True)  # (B?, H?, Lq, 1): rows that see no key
            if score_mod is not None:
                dead = torch.isneginf(s).all(-1, keepdim=True)  # a score_mod may hide entries too
        if dead is not None and bool(dead.any()):
            s = s.masked_fill(dead, 0.0)  # finite row; its output is zeroed below
        else:
            dead = None
        lse = None
        if spec.need_lse:
            lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq)
            if dead is not None:
                lse = lse.masked_fill(dead.squeeze(-1), float("-inf"))
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
        return out, (weights if spec.need_weights else None), lse


def _alternative(spec: AttentionSpec) -> str:
    for name in ("sdpa", "tiled"):
        if name in names() and get(name).supports(spec.with_(need_weights=False))[0]:
            return name
    return "sdpa"
