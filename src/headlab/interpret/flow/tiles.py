"""Exact attention probabilities tile by tile, from q, k and the log-sum-exp: never an n x n map.

``P_ij = exp(scale * q_i . k_j - lse_i)`` (0 where a causal mask hides j, and for a query row that
sees no key, ``lse = -inf``). Each tile is ``(H, bq, bk)``; a pass over all tiles costs what one
attention forward costs and holds ``H * bq * bk`` floats. The lse comes from
:func:`headlab.attention_stats` (its online-softmax pass), so the tiles here are exact rows of the map
the model used.

    >>> import torch
    >>> q, k = torch.randn(2, 9, 4), torch.randn(2, 9, 4)
    >>> P = torch.softmax(q @ k.transpose(1, 2) * 0.5, -1)           # (H, n, n)
    >>> lse = torch.logsumexp(q @ k.transpose(1, 2) * 0.5, -1)
    >>> w = torch.rand(3, 9)
    >>> torch.allclose(weighted_colsum(q, k, lse, w, scale=0.5, causal=False, block=4), torch.einsum("ri,hij->hrj", w, P), atol=1e-6)
    True
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

DEFAULT_BLOCK = 1024


def prob_tiles(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    block: int = DEFAULT_BLOCK,
    q_pos: torch.Tensor | None = None,
    rows: tuple[int, int] | None = None,
) -> Iterator[tuple[int, int, int, int, torch.Tensor]]:
    """Yield ``(r0, r1, c0, c1, P)`` with ``P = probs[:, r0:r1, c0:c1]`` ``(H, r1-r0, c1-c0)``.

    Args:
        q: ``(H, Lq, d)``; k: ``(H, Lk, d)`` (one key head per query head); lse: ``(H, Lq)``.
        q_pos: the positions of q's rows in the sequence (for the causal mask), default ``0..Lq-1``.
        rows: only the query rows ``r0:r1`` of that range (default all).
    """
    H, Lq, _ = q.shape
    Lk = k.shape[1]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    pos = torch.arange(Lq, device=q.device) if q_pos is None else q_pos.to(q.device)
    lo, hi = rows if rows is not None else (0, Lq)
    for r0 in range(lo, hi, block):
        r1 = min(hi, r0 + block)
        qc = q[:, r0:r1].to(ct) * scale  # (H, bq, d)
        l = lse[:, r0:r1].to(ct)  # (H, bq)
        dead = torch.isneginf(l)
        l = torch.where(dead, torch.zeros((), dtype=ct), l).unsqueeze(-1)  # (H, bq, 1)
        pmax = int(pos[r0:r1].max()) if causal else Lk
        for c0 in range(0, Lk, block):
            if causal and c0 > pmax:
                break
            c1 = min(Lk, c0 + block)
            s = torch.matmul(qc, k[:, c0:c1].to(ct).transpose(1, 2))  # (H, bq, bk)
            p = torch.exp_(s.sub_(l))
            if causal and c1 - 1 > int(pos[r0:r1].min()):
                hide = pos[r0:r1].view(-1, 1) < torch.arange(c0, c1, device=q.device).view(1, -1)  # (bq, bk)
                p.masked_fill_(hide, 0.0)
            if bool(dead.any()):
                p.masked_fill_(dead.unsqueeze(-1), 0.0)
            yield r0, r1, c0, c1, p


def weighted_colsum(
    q, k, lse, w: torch.Tensor, *, scale: float, causal: bool, block: int = DEFAULT_BLOCK
) -> torch.Tensor:
    """``out[h, r, j] = sum_i w[r, i] P_h[i, j]`` ``(H, R, Lk)`` for weights ``w (R, Lq)`` (or ``(H, R, Lq)``),
    in O((R + H) * n) memory: the products ``w P`` that carry rollout rows top-down."""
    H, Lq, _ = q.shape
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    w = w.to(ct)
    R = w.shape[-2]
    out = torch.zeros(H, R, k.shape[1], dtype=ct, device=q.device)
    live = (w != 0).reshape(-1, Lq).any(0)  # (Lq,) rows with any weight
    for r0 in range(0, Lq, block):
        r1 = min(Lq, r0 + block)
        if not bool(live[r0:r1].any()):
            continue
        wc = w[..., r0:r1]  # (R, bq) or (H, R, bq)
        for _, _, c0, c1, p in prob_tiles(q, k, lse, scale=scale, causal=causal, block=block, rows=(r0, r1)):
            out[:, :, c0:c1] += torch.matmul(wc if wc.dim() == 3 else wc.unsqueeze(0), p)  # (H, R, bk)
    return out


__all__ = ["DEFAULT_BLOCK", "prob_tiles", "weighted_colsum"]
