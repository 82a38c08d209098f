"""FlashAttention's forward pass as in the paper (Dao et al. 2022, Algorithm 1), without tricks.

Read this before :mod:`.forward`: the fast path computes the same thing, with a stale maximum,
the shift folded into the score matmul, row sums from a ones column of V, grouped heads and a
thread pool. Here: one query block at a time, a running maximum ``m``, normaliser ``l`` and
accumulator ``acc`` per query row, natural logarithms, no masks (causal aside).

    >>> import torch
    >>> q, k, v = (torch.randn(2, 3, 50, 8) for _ in range(3))
    >>> out, lse = flash_attention_textbook(q, k, v, causal=True, block_q=16, block_k=16)
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> torch.allclose(out, ref, atol=1e-5)
    True
"""

from __future__ import annotations

import math

import torch


def flash_attention_textbook(q, k, v, *, causal=False, scale=None, block_q=64, block_k=64):
    """``softmax(q k^T * scale) v`` and its log-sum-exp ``(B, H, Lq)``; q, k, v ``(B, H, T, D)``."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty(B, H, Lq, v.shape[-1], dtype=q.dtype)  # (B, H, Lq, Dv)
    lse = torch.empty(B, H, Lq, dtype=q.dtype)  # (B, H, Lq)
    for i0 in range(0, Lq, block_q):
        qi = q[:, :, i0 : i0 + block_q] * scale  # (B, H, bq, D)
        rows = torch.arange(i0, i0 + qi.shape[2]).view(-1, 1)  # (bq, 1) query positions
        m = torch.full(qi.shape[:3] + (1,), float("-inf"), dtype=q.dtype)  # (B, H, bq, 1) running max
        l = torch.zeros_like(m)  # (B, H, bq, 1) running sum of exp(s - m)
        acc = torch.zeros(qi.shape[:3] + (v.shape[-1],), dtype=q.dtype)  # (B, H, bq, Dv) running P V
        for j0 in range(0, Lk, block_k):
            if causal and j0 > rows[-1, 0]:
                break  # every later key is after every query of the block
            s = qi @ k[:, :, j0 : j0 + block_k].transpose(-1, -2)  # (B, H, bq, bk) scores of the tile
            if causal:
                s = s.masked_fill(torch.arange(j0, j0 + s.shape[-1]) > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))  # (B, H, bq, 1)
            p = torch.exp(s - m_new)  # (B, H, bq, bk) this tile's unnormalised probabilities
            alpha = torch.exp(m - m_new)  # rescales what was accumulated under the old maximum
            l = alpha * l + p.sum(-1, keepdim=True)
            acc = alpha * acc + p @ v[:, :, j0 : j0 + block_k]  # (B, H, bq, Dv)
            m = m_new
        out[:, :, i0 : i0 + block_q] = acc / l
        lse[:, :, i0 : i0 + block_q] = (m + torch.log(l)).squeeze(-1)
    return out, lse
