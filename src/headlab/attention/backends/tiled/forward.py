"""The tiled forward pass: the fast online softmax (stale maximum, shift folded into the matmul,
row sums from the value matmul) and the exact per-tile rescaling it falls back to.

Both work in natural-log units, with the same scaled query as the backward (``scale * q``,
rounded once), so the log-sum-exp they save gives back exactly the forward's probabilities when
the backward recomputes ``P = exp(scale q k^T - lse)``: converting an lse between base 2 and
base e cost float32 gradients up to 10x their plain error at large logits (measured).
Read :mod:`.textbook` first: it is the algorithm without the tricks.
"""

from __future__ import annotations

import threading

import torch

from headlab.attention.backends import _threads
from headlab.attention.backends.tiled.plan import Plan, mask_tile, modify_scores, prepare_kv, query_block
from headlab.spec.tile_states import EMPTY, PARTIAL

# Work unit of the forward: one query block x as many flattened (batch, kv head) slices as keep
# its score tile near this many entries (2 MiB in float32). Measured at 4,096 tokens, 2 threads,
# 256x512 tiles (docs/tiled.md): 1 head per unit pays Python overhead per op, all 8 heads (8 MiB
# tile) fall out of cache; 2 to 4 heads were fastest.
UNIT_ELEMS = 1 << 19


def head_chunk(p: Plan) -> int:
    return max(1, UNIT_ELEMS // (p.block_q * p.G * p.block_k))


def units(p: Plan, chunk: int) -> list[tuple[int, int, int]]:
    """``(qb, h0, h1)`` work units, the most expensive first (most visited tiles), so that a
    dynamic schedule ends with the cheap ones."""
    BHkv = p.B * p.Hkv
    work = [sum(1 for s in row if s != EMPTY) for row in p.states]
    order = sorted(range(p.n_qb), key=lambda qb: -work[qb])
    return [(qb, h0, min(BHkv, h0 + chunk)) for qb in order for h0 in range(0, BHkv, chunk)]


def forward_block_fast(qb_rows, kt, vaug, p: Plan, qb: int, out_rows, ml_rows, h0: int = 0, sbuf=None) -> bool:
    """One query block with the stale maximum. Writes ``out_rows (n, r, Dv)`` and ``ml_rows
    (n, r, 2)`` (the shift ``m`` and ``log l``: the log-sum-exp is their sum, kept apart so that
    the backward's ``(S - m) - log l`` is exact where it matters); returns False when the block must be recomputed exactly (not finite, or a row
    without keys). ``h0``: first flattened (batch, kv head) index of these rows (for masks).
    ``sbuf``: a flat scratch tensor of at least ``n * r * block_k`` entries for the score tile
    (reused: a fresh multi-MiB tensor per tile costs page faults that made the score matmul
    twice as slow)."""
    i0, i1 = p.q_rows(qb)
    BHkv, r, _ = qb_rows.shape
    Dv = p.Dv
    acc = torch.zeros(BHkv, r, Dv + 1, dtype=p.cdtype, device=qb_rows.device)  # [P V | rowsum P]
    negm = None
    for kb, state in enumerate(p.states[qb]):
        if state == EMPTY:
            continue
        j0, j1 = p.k_cols(kb, i1)
        s = torch.bmm(
            qb_rows,
            kt[:, :, j0:j1],  # (n, r, c) = scale q k^T - m (last q column)
            out=None if sbuf is None else sbuf[: BHkv * r * (j1 - j0)].view(BHkv, r, j1 - j0),
        )
        if state == PARTIAL:
            mask_tile(s, p, i0, i1, j0, j1, h0)
        if negm is None:  # first visited tile: its exact row maximum becomes the shift m
            negm = s.amax(-1, keepdim=True).neg_()  # (BHkv, r, 1)
            negm.masked_fill_(torch.isinf(negm), 0.0)  # a row empty in this tile: shift 0
            s.add_(negm)
            qb_rows[..., -1:] = negm
        s.exp_()
        if p.dropout_p > 0:
            acc[..., Dv] += s.sum(-1)
            s.masked_fill_(~p.keep(qb, kb, s.shape, s.device), 0.0)
            acc[..., :Dv].baddbmm_(s, vaug[:, j0:j1, :Dv], alpha=1.0 / (1.0 - p.dropout_p))
        else:
            acc.baddbmm_(s, vaug[:, j0:j1])  # P V and, through the ones column, rowsum P
        del s
    if negm is None:  # every tile of the block is empty
        out_rows.zero_()
        ml_rows[..., 0] = 0.0
        ml_rows[..., 1] = float("inf")
        return True
    l = acc[..., Dv]
    if not bool(torch.isfinite(acc).all()) or bool((l <= 0).any()):
        return False
    out_rows.copy_(acc[..., :Dv] / l.unsqueeze(-1))
    ml_rows[..., 0] = negm.squeeze(-1).neg()
    ml_rows[..., 1] = torch.log(l)
    return True


def forward_block_exact(qb_rows, kt, vaug, p: Plan, qb: int, out_rows, ml_rows, h0: int = 0) -> None:
    """One query block with the textbook online softmax: exact maximum per tile and rescaling.
    Also the path of score modifications and additive masks (element-wise work on raw scores).
    A row that sees no key gets zeros and ``log l = +inf``; a NaN score propagates."""
    i0, i1 = p.q_rows(qb)
    BHkv, r, _ = qb_rows.shape
    Dv = p.Dv
    acc = torch.zeros(BHkv, r, Dv, dtype=p.cdtype, device=qb_rows.device)
    l = torch.zeros(BHkv, r, 1, dtype=p.cdtype, device=qb_rows.device)
    m = torch.full((BHkv, r, 1), float("-inf"), dtype=p.cdtype, device=qb_rows.device)
    qb_rows[..., -1] = 0.0  # no shift folded into the matmul here
    for kb, state in enumerate(p.states[qb]):
        if state == EMPTY:
            continue
        j0, j1 = p.k_cols(kb, i1)
        s = torch.bmm(qb_rows, kt[:, :, j0:j1])  # (n, r, c) = scale q k^T
        if p.score_mod is not None:
            s = modify_scores(s, p, i0, i1, j0, j1, h0)
        if state == PARTIAL:
            mask_tile(s, p, i0, i1, j0, j1, h0)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
        alpha = torch.exp(m - m_safe)  # exp(-inf) = 0 for rows that had nothing
        s.sub_(m_safe).exp_()
        l.mul_(alpha).add_(s.sum(-1, keepdim=True))
        acc.mul_(alpha)
        if p.dropout_p > 0:
            s.masked_fill_(~p.keep(qb, kb, s.shape, s.device), 0.0)
            acc.baddbmm_(s, vaug[:, j0:j1, :Dv], alpha=1.0 / (1.0 - p.dropout_p))
        else:
            acc.baddbmm_(s, vaug[:, j0:j1, :Dv])
        m = m_new
    dead = l == 0  # (BHkv, r, 1): rows that see no key (NaN rows are not dead: NaN propagates)
    l_safe = torch.where(dead, torch.ones_like(l), l)
    out_rows.copy_((acc / l_safe).masked_fill_(dead, 0.0))
    ml_rows[..., 0] = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m).squeeze(-1)
    ml_rows[..., 1] = torch.log(l_safe).masked_fill_(dead, float("inf")).squeeze(-1)


def forward(q, k, v, p: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """``out (BHkv, Lq*G, Dv)`` and ``ml (BHkv, Lq*G, 2)``: per row the shift ``m`` and ``log l``
    (``lse = m + log l``; ``log l = +inf`` on rows with no key)."""
    kt, vaug = prepare_kv(k, v, p)
    BHkv = p.B * p.Hkv
    out = torch.empty(BHkv, p.Lq * p.G, p.Dv, dtype=p.cdtype, device=q.device)
    ml = torch.empty(BHkv, p.Lq * p.G, 2, dtype=p.cdtype, device=q.device)
    qg = q.reshape(BHkv, p.G, p.Lq, p.D)  # (B, H, Lq, D) -> (B*Hkv, G, Lq, D), a view when contiguous
    # dropout draws one keep-mask per whole tile (the backward regenerates it): no head split
    chunk = head_chunk(p) if p.dropout_p == 0 else BHkv
    scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per worker thread: score tile, query block

    def block(qb: int, h0: int, h1: int) -> None:
        i0, i1 = p.q_rows(qb)
        r0, r1 = i0 * p.G, i1 * p.G
        bufs = scratch.get(threading.get_ident())
        if bufs is None:
            rows = min(chunk, BHkv) * min(p.block_q, p.Lq) * p.G
            bufs = (
                torch.empty(rows * min(p.block_k, p.Lk), dtype=p.cdtype, device=q.device),
                torch.empty(rows * (p.D + 1), dtype=p.cdtype, device=q.device),
            )
            scratch[threading.get_ident()] = bufs
        sbuf, qbuf = bufs
        qb_rows = query_block(qg, p, qb, h0, h1, qbuf)  # its last column: the shift, per block
        args = (qb_rows, kt[h0:h1], vaug[h0:h1], p, qb, out[h0:h1, r0:r1], ml[h0:h1, r0:r1], h0)
        if p.elementwise or not forward_block_fast(*args, sbuf=sbuf):
            forward_block_exact(*args)

    _threads.run_units(lambda u: block(*u), units(p, chunk))
    return out, ml
