"""Counting visited tiles along diagonals: offset patterns of any stride or dilation, with global
tokens, documents, padding and small block layouts.

:mod:`headlab.costs.tiles.interval_count` needs the key tiles of a block row to be a few intervals. A stride
or dilation wider than a tile breaks that: tile ``(I, J)`` is visited when its offsets
``R(t) = [t - (wid - 1), t + (hgt - 1)]``, ``t = I bq - J bk``, hold a multiple of the stride, which
repeats along the row. This module counts by ``t`` instead:

1. The state of a tile under a tree of offset patterns depends on ``t`` alone (``&``, ``|``, ``~``
   combine per-tile states). Between a handful of *breakpoints* (where ``R(t)`` meets the end of a
   band) it is a fixed function of the bits "``R(t)`` holds a multiple of ``s``", one per stride or
   dilation ``s`` wider than the tile: :func:`headlab.costs.tiles.offset_nodes.leaf_state` with those bits left
   open.
2. Tiles sharing a ``t`` lie on a diagonal. With ``L = lcm(bq, bk)``, rows ``I = P m + r``
   (``P = L / bq``) and columns ``J = D n + e`` (``D = L / bk``) give ``t = (m - n) L + c``: along
   ``w = m - n`` the number of tiles ``N(w)`` of a rectangle of tiles is piecewise linear.
3. So the count is a sum over ``w`` of ``N(w) * [visited]``: an arithmetic series where the state
   is fixed, and, where it hangs on one bit, a difference of two floor sums
   (``floor((t + hgt - 1) / s) - floor((t - wid) / s)`` is that bit), :mod:`headlab.costs.tiles.floor_sums`.
   Several bits on one stretch are enumerated over their common period (refused above 2^16).
   Short stretches (a few diagonals, e.g. where the causal cut makes a tile's area vary) are
   summed diagonal by diagonal.

Global tokens, documents, padding and layouts are constant on rectangles of tiles between their
:meth:`cuts`; each rectangle is counted as above with their state fixed. Raises ``Unsupported`` for
any other node (a ``fixed`` pattern, BigBird) or too many rectangles.
"""

from __future__ import annotations

from math import gcd, lcm

from headlab.costs.tiles.floor_sums import floor_sums
from headlab.costs.tiles.grid import Grid, Unsupported, rectangles
from headlab.spec.tile_states import EMPTY

__all__ = ["count_diagonal"]

MAX_PERIOD = 1 << 16  # diagonals enumerated over the common period of several strides, at most
MAX_RECTS = 1 << 14  # rectangles of tiles between the cuts of global tokens, documents, layouts
_SHORT = 16  # stretches of at most this many diagonals are summed one by one


class Ctx:
    """One tile (or class of tiles) being evaluated: the node methods read it."""

    __slots__ = ("grid", "t", "hgt", "wid", "I", "J", "bits", "seen")

    def __init__(self, grid: Grid, hgt: int, wid: int, I: int, J: int):
        self.grid, self.hgt, self.wid, self.I, self.J = grid, hgt, wid, I, J
        self.t = 0
        self.bits: dict | None = None  # None: compute every bit; a dict: use (and record) these
        self.seen: set = set()

    def hit(self, s: int) -> bool:
        """Whether ``R(t)`` holds a multiple of ``s``; left open (``bits``) while tabling a stretch."""
        if self.hgt + self.wid - 1 >= s:  # s consecutive offsets always hold one
            return True
        if self.bits is None:
            return (self.t + self.hgt - 1) // s - (self.t - self.wid) // s >= 1
        self.seen.add(s)
        return self.bits.get(s, False)


def _table(tree, ctx: Ctx, t: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """``(strides, visited for each assignment of their bits)`` of the stretch holding ``t``."""
    ctx.t, ctx.bits, ctx.seen = t, {}, set()
    tree.state_at(ctx)
    mods = tuple(sorted(ctx.seen))
    out = []
    for bits in range(1 << len(mods)):
        ctx.bits = {s: bool(bits >> i & 1) for i, s in enumerate(mods)}
        out.append(tree.state_at(ctx) != EMPTY)
    ctx.bits = None
    if len(set(out)) == 1:
        return (), (out[0],)
    return mods, tuple(out)


def _area(t: int, hgt: int, wid: int, cut: bool) -> int:
    """Score entries of a tile; under the causal cut its keys stop at its last query: ``t + hgt``."""
    return hgt * (max(0, min(wid, t + hgt)) if cut else wid)


def _series(w0: int, n: int, a: int, b: int) -> int:
    """``sum (a w + b)`` over ``w = w0 .. w0 + n - 1``."""
    return a * (n * w0 + n * (n - 1) // 2) + b * n


def _stretch(tree, ctx: Ctx, w0: int, w1: int, L: int, c: int, nfun, mods, table, cut: bool):
    """``(tiles, entries)`` of the diagonals ``w in [w0, w1)`` (one stretch: ``N`` linear, one table)."""
    hgt, wid = ctx.hgt, ctx.wid
    n = w1 - w0
    if n <= _SHORT:
        tiles = pairs = 0
        for w in range(w0, w1):
            ctx.t = w * L + c
            if tree.state_at(ctx) != EMPTY:
                k = nfun(w)
                tiles += k
                pairs += k * _area(ctx.t, hgt, wid, cut)
        return tiles, pairs
    a = nfun(w0 + 1) - nfun(w0)
    b = nfun(w0) - a * w0
    area = _area(w0 * L + c, hgt, wid, cut)  # constant: the cut's breakpoints bound every stretch
    if not mods:
        k = _series(w0, n, a, b) if table[0] else 0
        return k, k * area
    if len(mods) == 1:
        s = mods[0]
        f1, g1 = floor_sums(n, L, w0 * L + c + hgt - 1, s)
        f2, g2 = floor_sums(n, L, w0 * L + c - wid, s)
        on = (a * w0 + b) * (f1 - f2) + a * (g1 - g2)  # sum of N(w) over the diagonals holding a multiple
        k = (table[1] and on) + (table[0] and _series(w0, n, a, b) - on)
        return k, k * area
    period = 1
    for s in mods:
        period = lcm(period, s // gcd(s, L))
    if period > MAX_PERIOD:
        raise Unsupported(f"strides {mods} repeat only every {period:,} diagonals")
    k = 0
    for rho in range(min(period, n)):
        ctx.t = (w0 + rho) * L + c
        if tree.state_at(ctx) != EMPTY:
            m = (n - rho + period - 1) // period  # diagonals w0 + rho + period * j in the stretch
            k += a * (m * (w0 + rho) + period * m * (m - 1) // 2) + b * m
    return k, k * area


def _rect(g: Grid, tree, ia: int, ib: int, ja: int, jb: int, hgt: int, wid: int, cut: bool):
    """``(tiles, entries)`` of the rectangle of tiles ``[ia, ib] x [ja, jb]`` of one size."""
    ctx = Ctx(g, hgt, wid, ia, ja)
    bps = sorted(set(tree.t_breaks(g, hgt, wid)) | ({1 - hgt, wid - hgt} if cut else set()))
    reps = [bps[0] - 1, *bps] if bps else [0]  # a t in each stretch of t
    tables = [_table(tree, ctx, t) for t in reps]
    bq, bk = g.block_q, g.block_k
    L = lcm(bq, bk)
    P, D = L // bq, L // bk
    tiles = pairs = 0
    for r in range(P):
        m_lo, m_hi = -((r - ia) // P), (ib - r) // P
        if m_hi < m_lo:
            continue
        for e in range(D):
            n_lo, n_hi = -((e - ja) // D), (jb - e) // D
            if n_hi < n_lo:
                continue
            c = r * bq - e * bk

            def nfun(w, m_lo=m_lo, m_hi=m_hi, n_lo=n_lo, n_hi=n_hi):  # tiles on diagonal w
                return max(0, min(m_hi, n_hi + w) - max(m_lo, n_lo + w) + 1)

            lo, hi = m_lo - n_hi, m_hi - n_lo + 1  # diagonals [lo, hi) hold tiles
            ws = {lo, hi, m_hi - n_hi, m_lo - n_lo}
            ws |= {-((c - t) // L) for t in bps}  # first diagonal with t >= breakpoint
            wl = sorted(w for w in ws if lo <= w <= hi)
            for w0, w1 in zip(wl, wl[1:]):
                k = sum(1 for t in bps if t <= w0 * L + c)  # the stretch of t holding diagonal w0
                dt, dp = _stretch(tree, ctx, w0, w1, L, c, nfun, *tables[k], cut)
                tiles, pairs = tiles + dt, pairs + dp
    return tiles, pairs


def _spans(cuts, lo: int, hi: int) -> list[tuple[int, int]]:
    """``[lo, hi]`` split at ``cuts`` (each cut starts a new span)."""
    edges = sorted({lo, hi + 1, *(x for x in cuts if lo < x <= hi)})
    return [(a, b - 1) for a, b in zip(edges, edges[1:])]


def count_diagonal(grid: Grid, tree, *, causal_cut: bool = False) -> tuple[int, int]:
    """``(visited tiles, score entries inside them)`` of a tree of offset patterns, global tokens,
    documents, padding and small layouts, per slice (see the module docstring); ``causal_cut`` as in
    :func:`headlab.costs.tiles.interval_count.count_tiles`. Raises ``Unsupported`` where a node has no form here."""
    g = grid
    n_qb, n_kb = g.n_qb, g.n_kb
    hq = g.q_len - (n_qb - 1) * g.block_q
    wk = g.kv_len - (n_kb - 1) * g.block_k
    rcuts, ccuts = tree.cuts(g)
    rows = [(a, b, g.block_q) for a, b in _spans(rcuts, 0, n_qb - 2)] + [(n_qb - 1, n_qb - 1, hq)]
    cols = [(a, b, g.block_k) for a, b in _spans(ccuts, 0, n_kb - 2)] + [(n_kb - 1, n_kb - 1, wk)]
    if len(rows) * len(cols) > MAX_RECTS:
        raise Unsupported(f"{len(rows) * len(cols):,} rectangles of tiles between global tokens, documents, layouts")
    tiles = pairs = 0
    for ia, ib, hgt, ja, jb, wid in rectangles(rows, cols):
        t, p = _rect(g, tree, ia, ib, ja, jb, hgt, wid, causal_cut)
        tiles, pairs = tiles + t, pairs + p
    return tiles, pairs
