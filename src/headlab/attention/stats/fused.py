"""Method ``"tiled"``, one pass: every statistic and the output from one matmul and one ``exp`` per score.

A work unit is one block of query rows of a few (batch, kv head) slices, with every key its rows
can see (the span from its first to its last visited key tile, see
:func:`headlab.spec.visibility.tile_states`), small enough (:data:`UNIT_ELEMS` scores) that
its score tile stays in one core's L2 cache. Units run in a pool of threads
(:mod:`headlab.attention.backends._threads`), each on its own scratch tiles. Per unit, with
``t = S - m`` (``m`` the row maximum), ``e = exp(t)``::

    one matmul      e @ [V | 1 | w | sigma]   ->  P V (unnormalised), l = sum_j e_j, and the
                                                  off-diagonal part of sum_j e_j |i - j|
    one pass        sum_j e_j t_j                 (entropy: H = log l - sum_j e_j t_j / l)
    one product     (1 / l)^T e                   (received: column sums of P)

``lse = m + log l``, ``max_weight = 1 / l`` (``e = 1`` at the maximum), ``argmax`` = the first
``j`` with ``t_j = 0`` (a block maximum, then one block). Distances: for keys left of the unit's
rows (``j < i0``) ``|i - j| = (i0 - j) + (i - i0)``, right of them (``j >= i1``)
``|i - j| = (j - i0) - (i - i0)``: the columns ``w`` (``i0 - j`` or ``j - i0``, never negative)
and ``sigma`` (+1 or -1) give ``sum_j e_j |i - j| = (e w)_i + (i - i0) (e sigma)_i`` with no
cancellation, and the ``n x n`` diagonal block is summed directly in float64.
"""

from __future__ import annotations

import threading

import torch

from headlab.attention.backends import _threads
from headlab.spec.attention_spec import AttentionSpec
from headlab.spec.tile_states import EMPTY, FULL
from headlab.spec.visibility import tile_states, visible

# Scores per unit (2 MiB in float32): a unit's tiles (scores and exp) stay in its core's L2.
UNIT_ELEMS = 1 << 19
# Query rows per unit: at least this many (fewer make Python overhead dominate), at most the cap.
MIN_ROWS, MAX_ROWS = 16, 512
# A finite stand-in for -inf: exp(NEG - m) is exactly 0 and 0 * (NEG - m) is 0, not NaN.
NEG = -1e30


def unit_rows(spec: AttentionSpec) -> int:
    """Query rows per unit: a power of two keeping ``group * rows * kv_len`` near UNIT_ELEMS."""
    r = UNIT_ELEMS // max(1, spec.group * spec.kv_len)
    r = max(MIN_ROWS, min(MAX_ROWS, r))
    r = 1 << (r.bit_length() - 1)
    return min(r, max(MIN_ROWS, 1 << (spec.q_len - 1).bit_length()))


def fits(spec: AttentionSpec, cache_bytes: int, itemsize: int) -> bool:
    """Whether one unit of the fewest rows (two tiles of them: scores and exp) fits ``cache_bytes``."""
    return 2 * spec.group * MIN_ROWS * spec.kv_len * itemsize <= cache_bytes


def _first_max(t: torch.Tensor) -> torch.Tensor:
    """``(N, R)`` index of the first zero of each row of ``t (N, R, W)`` whose maximum is exactly 0:
    block maxima of 64 keys, the first block that reaches 0, then the first zero in it (a direct
    ``argmax`` over the tile was 9x slower than its ``amax``)."""
    N, R, W = t.shape
    bs = 64
    nb = W // bs
    if W % bs == 0:
        parts = [t.view(N, R, nb, bs).amax(-1)]  # (N, R, nb)
    else:
        parts = [t[..., : nb * bs].unfold(2, bs, bs).amax(-1)] if nb else []
    if W % bs:
        parts.append(t[..., nb * bs :].amax(-1, keepdim=True))
    heads = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
    blk = (heads == 0).to(torch.uint8).argmax(-1, keepdim=True)  # (N, R, 1): first block holding the max
    idx = (blk * bs + torch.arange(bs, device=t.device)).clamp_max_(W - 1)  # (N, R, bs)
    pos = (t.gather(-1, idx) == 0).to(torch.uint8).argmax(-1, keepdim=True)
    return idx.gather(-1, pos).squeeze(-1)


def fused_stats(q, k, v, spec: AttentionSpec, mask, scale: float, want: set[str], ct: torch.dtype, block_k: int):
    B, H, Lq, D = q.shape
    Hkv, G, Lk = spec.kv_heads, spec.group, spec.kv_len
    BHkv, dev = B * Hkv, q.device
    r = unit_rows(spec)
    states = tile_states(spec, mask, r, block_k)  # (n_qb, n_kb) int8
    n_qb = states.shape[0]
    qs = (q.to(ct) * scale).reshape(BHkv, G, Lq, D)  # pre-scaled queries, grouped by kv head
    kc = k.to(ct).reshape(BHkv, Lk, D)
    Dv = v.shape[-1] if v is not None else 0
    vc = None
    if v is not None:
        vc = torch.ones(BHkv, Lk, Dv + 1, dtype=ct, device=dev)  # [V | 1]: the value matmul also sums each row
        vc[..., :Dv] = v.reshape(BHkv, Lk, Dv)
    want_ent, want_md, want_rec = "entropy" in want, "mean_distance" in want, "received" in want
    want_arg = "argmax" in want

    def new(*shape, dtype=ct, fill=None):
        t = torch.empty(*shape, dtype=dtype, device=dev)
        return t if fill is None else t.fill_(fill)

    acc = {
        "lse": new(BHkv, G, Lq),
        "max_weight": new(BHkv, G, Lq) if "max_weight" in want else None,
        "entropy": new(BHkv, G, Lq) if want_ent else None,
        "mean_distance": new(BHkv, G, Lq) if want_md else None,
        "argmax": new(BHkv, G, Lq, dtype=torch.long) if want_arg else None,
        "output": new(BHkv, G, Lq, Dv) if v is not None else None,
    }
    received: dict[int, torch.Tensor] = {}  # per worker thread: (BHkv * G, 1, Lk) column sums
    spans = []
    for qb in range(n_qb):
        hit = (states[qb] != EMPTY).nonzero().flatten().tolist()
        spans.append((hit[0] * block_k, min(Lk, (hit[-1] + 1) * block_k)) if hit else None)
    w_max = max((c1 - c0 for c0, c1 in filter(None, spans)), default=1)
    aux = [
        None if sp is None else _distance_columns(qb * r, min(Lq, qb * r + r), *sp, G, ct, dev, want_md, v is None)
        for qb, sp in enumerate(spans)
    ]  # per query block: shared by every head
    R_max = G * min(r, Lq)
    nh = max(1, min(BHkv, UNIT_ELEMS // (R_max * w_max)))  # (batch, kv head) slices per unit

    def width(sp: tuple[int, int] | None) -> int:
        return sp[1] - sp[0] if sp else 0

    order = sorted(range(n_qb), key=lambda qb: -width(spans[qb]))
    units = [(qb, h0, min(BHkv, h0 + nh)) for qb in order for h0 in range(0, BHkv, nh)]
    scratch: dict[int, tuple[torch.Tensor, ...]] = {}

    def unit(u) -> None:
        qb, h0, h1 = u
        i0, i1 = qb * r, min(Lq, qb * r + r)
        n, m_ = i1 - i0, h1 - h0
        R = G * n
        if spans[qb] is None:  # the block sees no key at all
            _write_dead(acc, h0, h1, i0, i1)
            return
        c0, c1 = spans[qb]
        w = c1 - c0
        tid = threading.get_ident()
        bufs = scratch.get(tid)
        if bufs is None:
            bufs = scratch[tid] = (new(nh * R_max * w_max), new(nh * R_max * w_max), new(nh * R_max * (Dv + 1)))
        sbuf, ebuf, obuf = bufs
        qr = qs[h0:h1, :, i0:i1].reshape(m_, R, D)  # (m, R, D), rows (g, i)
        s = torch.bmm(qr, kc[h0:h1, c0:c1].transpose(1, 2), out=sbuf[: m_ * R * w].view(m_, R, w))
        _mask_span(s.view(m_, G, n, w), spec, mask, states[qb], block_k, i0, i1, c0, c1, h0, Hkv)
        mx = s.amax(-1, keepdim=True)  # (m, R, 1)
        dead = mx < NEG / 2  # rows that see no key (a NaN row is not dead: NaN propagates)
        any_dead = bool(dead.any())
        if any_dead:
            mx.masked_fill_(dead, 0.0)
        t = s.sub_(mx)  # S - m <= 0, exactly 0 at the maximum
        arg = _first_max(t) if want_arg else None
        e = torch.exp(t, out=ebuf[: m_ * R * w].view(m_, R, w))
        if any_dead:
            e.masked_fill_(dead, 0.0)
        u_ent = torch.mul(e, t, out=t).sum(-1) if want_ent else None  # sum_j e_j t_j; t is spent
        cols, ii, dist = aux[qb]  # (w, 1 or 3) [1 | w | sigma]; (R,) i - i0; (n, wd) |i - j| of the diagonal
        oa = None
        if v is not None:
            assert obuf is not None and vc is not None  # allocated with v
            o = torch.bmm(e, vc[h0:h1, c0:c1], out=obuf[: m_ * R * (Dv + 1)].view(m_, R, Dv + 1))  # [P V | l]
            l = o[..., Dv]
            if want_md:
                oa = torch.bmm(e, cols.expand(m_, w, 2))  # (m, R, 2): sum_j e_j w_j, sum_j e_j sigma_j
        else:
            o = torch.bmm(e, cols.expand(m_, w, cols.shape[1]))  # (m, R, 1 or 3): [l | e w | e sigma]
            l = o[..., 0]
            oa = o[..., 1:] if want_md else None
        dead2 = dead.squeeze(-1)
        l_safe = l.masked_fill(dead2, 1.0) if any_dead else l
        inv_l = 1.0 / l_safe
        log_l = torch.log(l_safe)
        mx2 = mx.squeeze(-1)

        def put(name, val, fill):
            if any_dead:
                val = val.masked_fill(dead2.view(m_, R, *([1] * (val.dim() - 2))), fill)
            acc[name][h0:h1, :, i0:i1] = val.view(m_, G, n, *val.shape[2:])

        put("lse", mx2 + log_l, float("-inf"))
        if acc["max_weight"] is not None:
            put("max_weight", inv_l, 0.0)
        if arg is not None:
            put("argmax", arg + c0, -1)
        if u_ent is not None:
            put("entropy", log_l - u_ent * inv_l, 0.0)
        if v is not None:
            put("output", o[..., :Dv] * inv_l.unsqueeze(-1), 0.0)
        if want_md:
            assert oa is not None  # set above whenever want_md
            md = torch.addcmul(oa[..., 0], ii, oa[..., 1]).double()
            if dist is not None:  # the diagonal block, summed directly
                d0 = max(i0, c0)
                ed = e.view(m_, G, n, w)[..., d0 - c0 : d0 - c0 + dist.shape[1]]
                md += (ed * dist).sum(-1, dtype=torch.float64).view(m_, R)
            put("mean_distance", (md * inv_l.double()).to(ct), 0.0)
        if want_rec:
            rec = received.get(tid)
            if rec is None:
                rec = received[tid] = torch.zeros(BHkv * G, 1, Lk, dtype=ct, device=dev)
            ew = e.view(m_ * G, n, w)
            wts = inv_l.masked_fill(dead2, 0.0) if any_dead else inv_l
            rec[h0 * G : h1 * G, :, c0:c1].baddbmm_(wts.view(m_ * G, 1, n), ew)  # sum_i e_ij / l_i

    _threads.run_units(unit, units)
    res = {name: t.view(B, H, Lq, *t.shape[3:]) for name, t in acc.items() if t is not None}
    if want_rec:
        tot = torch.zeros(BHkv * G, 1, Lk, dtype=ct, device=dev)
        for rec in received.values():
            tot += rec
        res["received"] = tot.view(B, H, Lk)
    return res


def _distance_columns(i0: int, i1: int, c0: int, c1: int, G: int, ct, dev, want_md: bool, with_ones: bool):
    """For the rows ``[i0, i1)`` and their span ``[c0, c1)``: the value columns ``(w, k)`` (``[1]``
    when only row sums are needed, ``[1 | w | sigma]`` without values, ``[w | sigma]`` beside them),
    the row offsets ``i - i0`` of the ``G * n`` rows, and ``|i - j|`` on the diagonal block (or None)."""
    parts = [torch.ones(c1 - c0, dtype=ct, device=dev)] if with_ones else []
    n = i1 - i0
    ii = dist = None
    if want_md:
        j = torch.arange(c0, c1, device=dev)
        left, right = j < i0, j >= i1
        parts.append(torch.where(left, i0 - j, torch.where(right, j - i0, 0)).to(ct))
        parts.append(torch.where(left, 1.0, torch.where(right, -1.0, 0.0)).to(ct))
        ii = torch.arange(n, device=dev, dtype=ct).repeat(G)
        d0, d1 = max(i0, c0), min(i1, c1)
        if d0 < d1:
            dist = (torch.arange(i0, i1, device=dev)[:, None] - torch.arange(d0, d1, device=dev)[None, :]).abs_().to(ct)
    cols = torch.stack(parts, -1) if parts else None
    return cols, ii, dist


def _mask_span(s4, spec, mask, row_states, block_k: int, i0: int, i1: int, c0: int, c1: int, h0: int, Hkv: int):
    """Hide what the rows ``[i0, i1)`` may not see in their span ``[c0, c1)``: ``s4 (m, G, n, w)``
    of the flattened (batch, kv head) slices from ``h0``; empty tiles in the span are filled whole."""
    m_, G = s4.shape[:2]
    for kb in range(c0 // block_k, -(-c1 // block_k)):
        st = int(row_states[kb])
        if st == FULL:
            continue
        j0, j1 = kb * block_k, min(c1, kb * block_k + block_k)
        sl = s4[..., j0 - c0 : j1 - c0]  # (m, G, n, wj)
        if st == EMPTY:
            sl.fill_(NEG)
            continue
        vis = visible(spec, mask, (i0, i1), (j0, j1))  # (Bm, Hm, n, wj) bool
        assert vis is not None  # a partial tile: some pair is hidden
        Bm, Hm = vis.shape[:2]
        flat = torch.arange(h0, h0 + m_, device=vis.device)  # flattened (b, kv head) of each slice
        b_idx = flat // Hkv if Bm > 1 else torch.zeros_like(flat)
        if Hm > 1:  # per query head: slice's heads (kv head * G + g)
            h_idx = (flat % Hkv)[:, None] * G + torch.arange(G, device=vis.device)[None, :]  # (m, G)
            vm = vis[b_idx[:, None], h_idx]  # (m, G, n, wj)
        else:
            vm = vis[b_idx][:, :1]  # (m, 1, n, wj)
        sl.masked_fill_(~vm, NEG)


def _write_dead(acc, h0: int, h1: int, i0: int, i1: int) -> None:
    acc["lse"][h0:h1, :, i0:i1] = float("-inf")
    for name in ("max_weight", "entropy", "mean_distance", "output"):
        if acc[name] is not None:
            acc[name][h0:h1, :, i0:i1] = 0.0
    if acc["argmax"] is not None:
        acc["argmax"][h0:h1, :, i0:i1] = -1
