"""The local work of one ring step: attention between a query chunk and a key/value chunk.

Chunks carry their global start, so masks are functions of global positions. :func:`relation` says
what a (query chunk, key chunk) pair needs: nothing (every pair hidden), no mask (every pair visible,
e.g. a key chunk wholly before a query chunk under causal attention), torch's ``is_causal`` (the same
chunk on the diagonal), or a mask function shifted to global positions.

- :func:`pair_update`: fold a pair into the rank's online-softmax state (running maximum m,
  normaliser l, accumulator acc: FlashAttention's forward, with the key tiles arriving from other ranks).
- :func:`pair_backward`: FlashAttention's backward for the pair from the final state and
  ``D = rowsum(dO * O)`` (P = exp(S - m) / l; dV = P^T dO; dS = P (dO V^T - D); dQ = dS K scale;
  dK = dS^T Q scale).

Both walk the same query x key tiles through :func:`score_tiles`, so the backward recomputes
bit-for-bit the scores the forward saw. P is rebuilt as ``exp(S - m) / l`` from the final maximum m
(a score, exact in the tile precision) and the normaliser l (kept in float64), rather than from a
rounded log-sum-exp, so the recomputed probabilities are as accurate as a plain softmax's. The tiles
are computed in float32 (float64 for float64 inputs), as a plain implementation would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from headlab.attention.backends import native
from headlab.spec.attention_spec import validate

TILE = 512  # query and key positions per tile (forward, backward and statistics walk the same tiles)


@dataclass(frozen=True)
class Pair:
    """A query chunk against a key chunk, with what their visibility needs."""

    q0: int  # global position of the query chunk's first row
    k0: int  # global position of the key chunk's first column
    kind: str  # "full", "causal" (aligned diagonal), "fn" (shifted mask function) or "skip"
    fn: Callable | None = None  # for kind "fn": visible(b, h, q_local, k_local) -> bool


def relation(q0: int, ql: int, k0: int, kl: int, *, causal: bool, mask: Callable | None, n: int) -> Pair:
    """What the pair (queries ``[q0, q0+ql)``, keys ``[k0, k0+kl)``) needs; ``mask`` sees global positions
    of a sequence of ``n`` (a :class:`~headlab.masks.MaskFn` is evaluated with ``q_len = kv_len = n``)."""
    if causal and k0 > q0 + ql - 1:
        return Pair(q0, k0, "skip")
    if mask is None:
        if not causal or k0 + kl - 1 <= q0:
            return Pair(q0, k0, "full")
        if q0 == k0 and ql == kl:
            return Pair(q0, k0, "causal")

    def fn(b, h, qi, ki, _q0=q0, _k0=k0):
        gq, gk = qi + _q0, ki + _k0
        if mask is None:
            seen = torch.ones((), dtype=torch.bool)
        elif hasattr(mask, "evaluate"):  # headlab.masks: lengths matter (documents, lower-right causal)
            seen = mask.evaluate(b, h, gq, gk, n, n)
        else:
            seen = mask(b, h, gq, gk)
        return seen & (gk <= gq) if causal else seen

    return Pair(q0, k0, "fn", fn)


def _visible_tile(pair: Pair, B: int, H: int, r0: int, r1: int, c0: int, c1: int, device) -> torch.Tensor | None:
    """Bool ``(B|1, H|1, r1-r0, c1-c0)`` of visible pairs in a tile, or None when all are visible."""
    if pair.kind == "full":
        return None
    qi = torch.arange(r0, r1, device=device).view(1, 1, -1, 1)
    ki = torch.arange(c0, c1, device=device).view(1, 1, 1, -1)
    if pair.kind == "causal":
        return ki <= qi
    b = torch.arange(B, device=device).view(-1, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, -1, 1, 1)
    assert pair.fn is not None  # kind "fn"
    return torch.as_tensor(pair.fn(b, h, qi, ki), device=device).bool()


def score_tiles(q, k, pair: Pair, scale: float, compute_dtype):
    """Yield ``(r0, r1, c0, c1, S, seen)`` for every tile that may hold a visible pair: scores
    ``S (B, Hkv, G, bq, bk)`` (hidden pairs at ``-inf``) and the visibility (None when all are visible).
    q ``(B, H, ql, d)``, k ``(B, Hkv, kl, d)``; query head h reads kv head ``h // G``."""
    B, H, ql, d = q.shape
    Hkv, kl = k.shape[1], k.shape[2]
    G = H // Hkv
    for r0 in range(0, ql, TILE):
        r1 = min(r0 + TILE, ql)
        qt = q[:, :, r0:r1].to(compute_dtype).reshape(B, Hkv, G, r1 - r0, d)  # (B, Hkv, G, bq, d)
        for c0 in range(0, kl, TILE):
            c1 = min(c0 + TILE, kl)
            if pair.kind == "causal" and c0 > r1 - 1:
                break  # above the diagonal: nothing visible in this or any later key tile
            kt = k[:, :, c0:c1].to(compute_dtype).unsqueeze(2)  # (B, Hkv, 1, bk, d)
            S = (qt @ kt.transpose(-1, -2)) * scale  # (B, Hkv, G, bq, bk)
            seen = _visible_tile(pair, B, H, r0, r1, c0, c1, q.device)
            if seen is not None:
                seen = seen.expand(B, H, r1 - r0, c1 - c0).reshape(B, Hkv, G, r1 - r0, c1 - c0)
                S = S.masked_fill(~seen, -math.inf)
            yield r0, r1, c0, c1, S, seen


def probabilities(S: torch.Tensor, m: torch.Tensor, inv_l: torch.Tensor) -> torch.Tensor:
    """``P = exp(S - m) / l`` for a tile (m, 1/l shaped to broadcast); 0 for hidden pairs and dead rows
    (``m = -inf``, ``inv_l = 0``)."""
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return torch.exp(S - m_safe) * inv_l


def pair_update(q, k, v, pair: Pair, scale: float, m, l, acc) -> None:
    """Fold the pair into the online-softmax state of its queries, in place (views of the rank's state):
    ``m (B, H, ql)`` running maximum (tile precision), ``l (B, H, ql)`` float64 normaliser,
    ``acc (B, H, ql, dv)`` running ``sum exp(s - m) v``."""
    B, H, ql, _ = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    ct = tile_dtype(q.dtype)
    m4 = m.reshape(B, Hkv, G, ql, 1)
    l4 = l.reshape(B, Hkv, G, ql, 1)
    acc4 = acc.reshape(B, Hkv, G, ql, acc.shape[-1])
    for r0, r1, c0, c1, S, _seen in score_tiles(q, k, pair, scale, ct):
        m_old = m4[..., r0:r1, :]
        m_new = torch.maximum(m_old, S.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        e = torch.exp(S - m_safe)  # (B, Hkv, G, bq, bk), 0 where hidden
        alpha = torch.exp(m_old - m_safe)  # 0 while nothing was seen
        vt = v[:, :, c0:c1].to(ct).unsqueeze(2)  # (B, Hkv, 1, bk, dv)
        l4[..., r0:r1, :] = l4[..., r0:r1, :] * alpha.double() + e.sum(-1, keepdim=True, dtype=torch.float64)
        acc4[..., r0:r1, :] = acc4[..., r0:r1, :] * alpha + e @ vt
        m4[..., r0:r1, :] = m_new


def tile_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision of the score tiles: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def pair_backward(q, k, v, do, m, inv_l, D, pair: Pair, scale: float, dq, dk, dv) -> None:
    """Add the pair's contributions to ``dq (B, H, ql, d)``, ``dk (B, Hkv, kl, d)``, ``dv (B, Hkv, kl, dv)``
    (accumulators updated in place). ``m``, ``inv_l`` (= 1/l) and ``D`` ``(B, H, ql)`` are the final ones."""
    B, H, ql, d = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    ct = tile_dtype(q.dtype)
    for r0, r1, c0, c1, S, _seen in score_tiles(q, k, pair, scale, ct):
        bq = r1 - r0
        P = probabilities(S, m[:, :, r0:r1].reshape(B, Hkv, G, bq, 1), inv_l[:, :, r0:r1].reshape(B, Hkv, G, bq, 1))
        dot = do[:, :, r0:r1].to(ct).reshape(B, Hkv, G, bq, -1)  # (B, Hkv, G, bq, dv)
        vt = v[:, :, c0:c1].to(ct).unsqueeze(2)  # (B, Hkv, 1, bk, dv)
        kt = k[:, :, c0:c1].to(ct).unsqueeze(2)  # (B, Hkv, 1, bk, d)
        qt = q[:, :, r0:r1].to(ct).reshape(B, Hkv, G, bq, d)
        Dt = D[:, :, r0:r1].to(ct).reshape(B, Hkv, G, bq, 1)
        dv[:, :, c0:c1] += (P.transpose(-1, -2) @ dot).sum(2).to(dv.dtype)  # (B, Hkv, bk, dv)
        dS = P * (dot @ vt.transpose(-1, -2) - Dt)  # (B, Hkv, G, bq, bk)
        dq[:, :, r0:r1] += ((dS @ kt).reshape(B, H, bq, d) * scale).to(dq.dtype)
        dk[:, :, c0:c1] += ((dS.transpose(-1, -2) @ qt).sum(2) * scale).to(dk.dtype)


# ---------------------------------------------------------------------------------------------------
# The compiled one-pass kernel (headlab.attention.backends.native) for the pairs it takes: every pair of
# the zigzag causal layout and of unmasked attention is "full" or "causal" (the aligned diagonal). Other
# pairs (mask functions) and the calls the kernel declines (float64, a dispatch mode) run on the PyTorch
# tiles above.


def native_takes(q, k, v) -> bool:
    """Whether the compiled kernel takes this rank's unmasked pairs (``native.declines`` on the shards)."""
    spec, _ = validate(q, k, v)
    return native.declines(spec, None, tile_dtype(q.dtype)) is None


def native_pair_update(q, k, v, causal: bool, scale: float, m, l, acc) -> None:
    """:func:`pair_update` for a "full" or aligned "causal" pair on the compiled kernel: the pair's own
    softmax (output o_p, maximum m_p, normaliser l_p) merged exactly into the state, in place:
    ``m' = max(m, m_p)``, ``l' = l e^(m - m') + l_p e^(m_p - m')``, ``acc' = acc e^(m - m') + o_p l_p e^(m_p - m')``."""
    fwd = native.forward(q, k, v, None, scale, causal=causal)  # (B, H, ql, .)
    m_new = torch.maximum(m, fwd.m)  # every row of a full or causal pair sees a key: m_new is finite
    a = torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp(m - m_new))
    wb = fwd.l * torch.exp(fwd.m - m_new).double()  # l_p e^(m_p - m'), float64
    l.mul_(a.double()).add_(wb)
    acc.mul_(a.unsqueeze(-1)).add_(fwd.out * wb.to(acc.dtype).unsqueeze(-1))
    m.copy_(m_new)


def native_pair_backward(q, k, v, do, m, log_l, D, causal: bool, scale: float, dq, dk, dv) -> None:
    """:func:`pair_backward` for a "full" or aligned "causal" pair on the compiled kernel (P rebuilt as
    ``exp(s - m - log l)`` from the final maximum and normaliser); adds into ``dq``, ``dk``, ``dv`` (views)."""
    native.backward(q, k, v, do, m, log_l, None, scale, causal=causal, delta=D, into=(dq, dk, dv))
