"""Decode attention read straight from KIVI's codes (Liu et al. 2024), with no dequantized copy of the cache.

A quantized kv head holds, in position order, full-precision sinks, quantized keys (per channel: token group
``g`` has a scale ``s[g, c]`` and a zero ``z[g, c]`` per channel ``c``), a full-precision key residual, and
likewise values (per token: token ``t`` has ``s[t, j]``, ``z[t, j]`` per group ``j`` of channels) with their own
residual (:mod:`headlab.decode.quant`). A query ``q`` then scores a quantized key ``j`` of group ``g`` as

    q . k_j = sum_c q_c (s[g, c] code[j, c] + z[g, c]) = (q * s[g]) . code_j  +  q . z[g]

so the scores of a group are one product of the unpacked codes with ``q * s[g]``, plus one number; and the
output over quantized values is, per channel group ``j``,

    sum_t P_t (s[t, j] code[t] + z[t, j]) = (P * s[:, j]) @ code[:, group j]  +  (P @ z[:, j])

(``P`` the softmax weights). :func:`attend_codes` computes both in float32 a chunk of tokens at a time (the
codes of one chunk are unpacked and widened, never the whole cache, and no scale is expanded to a row per
token), the softmax over the sinks, the quantized keys and the residual together, and returns the output and
its log-sum-exp (what RazorAttention's compensation merges with). It serves a decode step, where the one
new query sees everything the head holds.

    >>> import torch
    >>> from headlab.decode import quant
    >>> from headlab.decode.codes import attend_codes
    >>> _ = torch.manual_seed(0); k, v, q = torch.randn(1, 1, 64, 8), torch.randn(1, 1, 64, 8), torch.randn(1, 2, 1, 8)
    >>> kq = quant.quantize_keys(k, 4, 32); vq = quant.quantize_values(v, 4, 4)
    >>> out, lse = attend_codes(q, keys=kq, key_group=32, values=vq, bits=4, scale=8 ** -0.5)
    >>> kd = quant.dequantize_keys(*kq, bits=4, group=32); vd = quant.dequantize_values(*vq, bits=4)
    >>> ref = torch.softmax(q @ kd.transpose(-1, -2) / 8 ** 0.5, -1) @ vd   # 2 query heads share the kv head
    >>> bool(torch.allclose(out, ref, atol=1e-5)), tuple(out.shape), tuple(lse.shape)
    (True, (1, 2, 1, 8), (1, 2, 1))
"""

from __future__ import annotations

import torch

from headlab.attention.backends import native_codes
from headlab.decode.quant import unpack
from headlab.errors import ShapeError

__all__ = ["attend_codes", "key_scores", "plane_order", "planes", "value_output", "CHUNK"]

CHUNK = 2048  # tokens unpacked at a time: bounds the widened codes to CHUNK x head dim float32 numbers


def _heads(q: torch.Tensor, h: int) -> tuple[torch.Tensor, int]:
    """``q (B, H, m, d)`` -> float32 ``(B, h, H // h * m, d)``: each kv head's query rows (grouped-query)."""
    B, H, m, d = q.shape
    if H % h:
        raise ShapeError(f"{H} query heads do not divide into {h} kv heads")
    return q.float().reshape(B, h, H // h * m, d), H // h


def planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed ``codes (..., d * bits / 8)`` read as float32 ``(..., d)`` in **plane order**: the first code of
    every byte, then the second, ... (column ``j * d * bits / 8 + i`` is channel ``(8 // bits) * i + j``), each
    plane read with one shift and one mask, so no interleaving copy is made; :func:`plane_order` permutes a
    vector of channels the same way."""
    per = 8 // bits
    if per == 1:
        return codes.float()
    mask = (1 << bits) - 1
    return torch.cat([codes & mask] + [(codes >> (bits * j)) & mask for j in range(1, per)], -1).float()


def plane_order(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x (..., d)`` with its channels in the order :func:`planes` reads them."""
    per = 8 // bits
    return x if per == 1 else torch.cat([x[..., j::per] for j in range(per)], -1)


def key_scores(
    qf: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    *,
    bits: int,
    group: int,
    head: int | None = None,
    native: bool = True,
) -> torch.Tensor:
    """``qf (B, h, r, d)`` float32 rows against quantized keys ``codes (B, h, t, d * bits / 8)`` whose scale and
    zero rows ``(B, h, G, d)`` cover ``head`` tokens (the first group, which a window may have cut short; default
    a whole ``group``) then ``group`` tokens each: ``(B, h, r, t)`` float32 scores ``q . k``, unscaled. The compiled
    kernel computes them when it is built (:mod:`headlab.attention.backends.native_codes`; ``native=False``: this
    PyTorch path, which the tests compare it with)."""
    B, h, t, _ = codes.shape
    head = min(group if head is None else head, t)
    rest = t - head
    if rest % group:
        raise ShapeError(f"{rest} quantized keys past the first group are not whole groups of {group}")
    fast = native_codes.key_scores(qf, codes, scale, zero, bits=bits, group=group, head=head) if native else None
    if fast is not None:
        return fast
    qs = plane_order(qf.unsqueeze(2) * scale.float().unsqueeze(3), bits)  # (B, h, G, r, d): q * s[g], plane order
    qz = (qf.unsqueeze(2) * zero.float().unsqueeze(3)).sum(-1)  # (B, h, G, r): q . z[g]
    out = qf.new_empty(B, h, qf.shape[2], t)
    if head:  # the first group
        out[..., :head] = qs[:, :, 0] @ planes(codes[:, :, :head], bits).transpose(-1, -2) + qz[:, :, 0, :, None]
    step = max(1, CHUNK // group)  # groups per chunk
    for g0 in range(0, rest // group, step):
        n = min(step, rest // group - g0)
        a = head + g0 * group
        rows = slice(1 + g0, 1 + g0 + n) if head else slice(g0, g0 + n)
        c = planes(codes[:, :, a : a + n * group], bits).reshape(B, h, n, group, -1)  # (B, h, n, group, d)
        s = qs[:, :, rows] @ c.transpose(-1, -2) + qz[:, :, rows, :, None]  # (B, h, n, r, group)
        out[..., a : a + n * group] = s.transpose(2, 3).reshape(B, h, -1, n * group)
    return out


def value_output(
    p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *, bits: int, native: bool = True
) -> torch.Tensor:
    """Weights ``p (B, h, r, t)`` float32 on quantized values ``codes (B, h, t, dv * bits / 8)`` with scale and
    zero ``(B, h, t, dv / group)``: ``(B, h, r, dv)`` float32, ``sum_t p_t v_t`` (the compiled kernel's when it is
    built, as :func:`key_scores`)."""
    fast = native_codes.value_output(p, codes, scale, zero, bits=bits) if native else None
    if fast is not None:
        return fast
    B, h, t, packed = codes.shape
    per = 8 // bits
    dv = packed * per
    G = scale.shape[-1]
    group = dv // G
    if group % per:  # a channel group splits a byte: read the codes in channel order
        return _value_output_unpacked(p, codes, scale, zero, bits=bits)
    cols = group // per  # columns of a plane in one channel group
    r = p.shape[2]
    s_t = scale.float().transpose(-1, -2).contiguous()  # (B, h, G, t)
    acc = p.new_zeros(B, h, G, r, dv)  # every channel group's weights on every column (G is small): one product
    for a in range(0, t, CHUNK):
        b = min(t, a + CHUNK)
        w = (s_t[:, :, :, None, a:b] * p[:, :, None, :, a:b]).reshape(B, h, G * r, b - a)  # p_t s[t, j], stacked
        acc += (w @ planes(codes[:, :, a:b], bits)).reshape(B, h, G, r, dv)
    acc = acc.reshape(B, h, G, r, per, packed)
    out = torch.stack([acc[:, :, gi, ..., gi * cols : (gi + 1) * cols] for gi in range(G)], -1)  # (B,h,r,per,cols,G)
    out = out.permute(0, 1, 2, 5, 4, 3).reshape(B, h, r, dv)  # channel gi * group + per * column + plane
    pz = (p @ zero.float()).repeat_interleave(group, -1)  # (B, h, r, dv): sum_t p_t z[t, group of c]
    return out + pz


def _value_output_unpacked(p, codes, scale, zero, *, bits: int) -> torch.Tensor:
    B, h, t, packed = codes.shape
    dv = packed * 8 // bits
    G = scale.shape[-1]
    group = dv // G
    out = p.new_zeros(B, h, p.shape[2], G, group)
    for a in range(0, t, CHUNK):
        b = min(t, a + CHUNK)
        c = unpack(codes[:, :, a:b], bits).float()  # (B, h, n, dv)
        ps = p[..., a:b].unsqueeze(-1) * scale[:, :, a:b].float().unsqueeze(2)  # (B, h, r, n, G)
        for j in range(G):
            out[..., j, :] += ps[..., j] @ c[..., j * group : (j + 1) * group]
    return (out + (p @ zero.float()).unsqueeze(-1)).reshape(B, h, p.shape[2], dv)


def attend_codes(
    q: torch.Tensor,
    *,
    keys=None,
    key_group: int = 32,
    key_head: int | None = None,
    values=None,
    bits: int,
    scale: float | None = None,
    softcap: float | None = None,
    full_before: tuple[torch.Tensor, torch.Tensor] | None = None,
    keys_after: torch.Tensor | None = None,
    values_after: torch.Tensor | None = None,
    native: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q (B, H, m, d)`` (all of whose rows see every key held) on one kv group's held keys and
    values, in position order ``full_before`` (the sinks: ``(keys, values)`` ``(B, h, s, d)``), the quantized
    part, then the full-precision residuals ``keys_after``, ``values_after``; keys and values quantized up to
    different positions (KIVI's two boundaries), but both sequences cover the same positions.

    ``keys``: ``(codes, scale, zero)`` per channel, groups of ``key_group`` tokens, the first ``key_head`` long;
    ``values``: ``(codes, scale, zero)`` per token. ``scale``: the softmax scale (default ``d ** -0.5``);
    ``softcap``: Gemma 2's ``tanh`` capping of the scaled scores; ``native=False``: the PyTorch products even when
    the compiled kernel is built. Returns ``(out (B, H, m, dv) in q's dtype,
    lse (B, H, m) float32)``."""
    B, H, m, d = q.shape
    parts = [
        t for t in (full_before[0] if full_before else None, keys[0] if keys else None, keys_after) if t is not None
    ]
    if not parts:
        raise ShapeError("attention on a kv group that holds no key")
    h = parts[0].shape[1]
    qf, rep = _heads(q, h)
    scores = []
    if full_before is not None:
        scores.append(qf @ full_before[0].float().transpose(-1, -2))
    if keys is not None:
        scores.append(key_scores(qf, *keys, bits=bits, group=key_group, head=key_head, native=native))
    if keys_after is not None:
        scores.append(qf @ keys_after.float().transpose(-1, -2))
    s = torch.cat(scores, -1) if len(scores) > 1 else scores[0]
    s = s * (d**-0.5 if scale is None else scale)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - lse)  # (B, h, rep * m, N)
    outs, at = [], 0
    if full_before is not None:
        n = full_before[1].shape[2]
        outs.append(p[..., :n] @ full_before[1].float())
        at = n
    if values is not None:
        n = values[0].shape[2]
        outs.append(value_output(p[..., at : at + n], *values, bits=bits, native=native))
        at += n
    if values_after is not None:
        n = values_after.shape[2]
        outs.append(p[..., at : at + n] @ values_after.float())
        at += n
    if at != p.shape[-1]:
        raise ShapeError(f"a kv group holds {p.shape[-1]} keys but {at} values")
    out = outs[0]
    for o in outs[1:]:
        out = out + o
    dv = out.shape[-1]
    return out.reshape(B, H, m, dv).to(q.dtype), lse.reshape(B, H, m)
