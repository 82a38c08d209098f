"""The Sparse Transformer's *fixed* pattern as the tile counters see it, for any stride.

``fixed(s, c)``: a query sees the keys of its own block of ``s`` positions and the last ``c`` keys
("summary" keys) of every block (of every earlier one under ``causal``). Block row ``I`` (queries
``[qs, qe]``) visits

* the key tiles from ``Jb = floor(floor(qs / s) s / bk)`` (the tile holding its first query's block
  start) up to the diagonal tile ``Jd = floor(qe / bk)`` (up to the tile of its last query's block
  end without ``causal``): an interval;
* and, outside that interval, every key tile holding a summary key. Whether a tile of ``wid`` keys
  from ``ks`` holds one repeats every ``s`` keys: ``floor((ks + wid - 1 + c) / s) > floor(ks / s)``.

:class:`Fixed` gives :mod:`headlab.costs.tiles.interval_count` these sets when each key tile holds a summary
key (tiles at least ``s`` wide). For narrower tiles :func:`count_fixed` counts the pattern alone (or
ANDed with ``causal``, the form a causal call takes): a block row's count is a few integer
operations once the summary tiles of one period of ``s`` keys are tabled, and it grows by the same
amount every ``Lambda`` rows (``Lambda bq`` a multiple of ``lcm(s, bk)``), so each stretch of rows
between the edges is summed from two periods of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd, lcm

import numpy as np

from headlab.costs.tiles.grid import Grid, Row, Unsupported
from headlab.costs.tiles.logic_nodes import CAUSAL, And
from headlab.costs.tiles.offset_nodes import Node, band_sets

__all__ = ["Fixed", "count_fixed"]

MAX_PERIOD = 1 << 21  # rows (and key tiles) of one period tabled at most


@dataclass(frozen=True)
class Fixed(Node):
    """``fixed(s, c)``: same block of ``s`` positions, or a key among the last ``c`` of its block.

    A key tile at least ``s`` wide holds a summary key, so it is visible wherever causality allows
    (and everywhere without ``causal``). A narrower tile (the last one) is decided per block row:
    it holds a summary key, or a query and a key of one block (the diagonal, under ``causal``).
    """

    s: int
    c: int
    causal: bool

    def _summaries(self, a: int, b: int) -> int:
        """Summary keys in ``[a, b]``."""
        s, c = self.s, self.c

        def below(x):  # summary keys < x
            return (x // s) * c + max(0, x % s - (s - c))

        return below(b + 1) - below(a)

    def sets(self, row: Row, need_full: bool):
        if need_full:
            raise Unsupported("full tiles of the fixed pattern (under ~)")
        g = row.grid
        if row.wid >= self.s:
            return (band_sets(row, 0, None)[0] if self.causal else row.all()), None
        if row.j0.b != g.n_kb - 1:
            raise Unsupported(f"fixed stride {self.s} wider than the key tiles ({g.block_k})")
        ks, ke = row.j0.b * g.block_k, g.kv_len - 1
        qs = row.row * g.block_q
        qe = qs + row.hgt - 1
        if self.causal:  # summary keys at or before every row, the diagonal, or one block across the edge
            seen = qe >= ks and (ke >= qs or self._summaries(ks, ke) > 0 or ke // self.s == qs // self.s)
        else:
            seen = self._summaries(ks, ke) > 0 or (qs // self.s <= ke // self.s and ks // self.s <= qe // self.s)
        return (row.all() if seen else []), None

    def breaks(self, g: Grid):
        # rows where the last key tile's answer can change: near the block edges around it
        ks = (g.n_kb - 1) * g.block_k
        out = []
        for x in (ks, g.kv_len - 1, (ks // self.s) * self.s, ((g.kv_len - 1) // self.s) * self.s + self.s - 1):
            out += [x // g.block_q + d for d in (-1, 0, 1, 2)]
        return [b for b in out if b >= 0]


class _Rows:
    """Visited tiles (and their score entries) of block rows of one height, vectorised over rows."""

    def __init__(self, g: Grid, f: Fixed, cut_causal: bool, cut: bool):
        self.g, self.f, self.causal, self.cut = g, f, f.causal or cut_causal, cut
        s, c, bk = f.s, f.c, g.block_k
        self.n_full = g.n_kb - 1  # key tiles of full width: [0, n_full)
        self.wk = g.kv_len - self.n_full * bk  # width of the last key tile
        self.period = s // gcd(s, bk)  # summary-ness of full-width key tiles repeats every `period` tiles
        if self.period > MAX_PERIOD:
            raise Unsupported(f"fixed stride {s}: {self.period:,} key tiles to a period")
        j = np.arange(self.period, dtype=np.int64) * bk
        flag = ((j + bk - 1 + c) // s - j // s) >= 1
        self.table = np.concatenate(([0], np.cumsum(flag)))  # summary tiles among the first x of a period
        self.per = int(self.table[-1])
        ks = self.n_full * bk  # the last key tile [ks, kv_len - 1]
        self.last_summary = f._summaries(ks, g.kv_len - 1) > 0

    def summary_tiles(self, x):
        """Full-width key tiles holding a summary key among the first ``x`` (``0 <= x <= n_full``)."""
        return (x // self.period) * self.per + self.table[x % self.period]

    def per_row(self, rows: np.ndarray, hgt: int) -> tuple[np.ndarray, np.ndarray]:
        """Visited tiles and the key positions they span (cut at the diagonal under ``cut``), per
        block row of height ``hgt`` in ``rows``."""
        g, s, bk, bq = self.g, self.f.s, self.g.block_k, self.g.block_q
        qs = rows * bq
        qe = qs + hgt - 1
        start = (qs // s) * s  # the first key of the row's own blocks (past the keys: no interval)
        jb = np.where(start < g.kv_len, start // bk, g.n_kb)  # the key tile holding it
        if self.causal:
            jh = qe // bk  # the diagonal tile
        else:
            jh = ((qe // s) * s + s - 1) // bk  # the tile of the last block's end
        jh = np.minimum(jh, g.n_kb - 1)
        nf = self.n_full
        # the interval [jb, jh] (jb <= jh always: the first query's block starts before the last query)
        lo_f, hi_f = np.minimum(jb, nf), np.minimum(jh, nf - 1)
        inner = np.maximum(0, hi_f - lo_f + 1)  # full-width tiles of the interval
        left = self.summary_tiles(lo_f)  # summary tiles before the interval
        # the last (narrow) tile: in the interval, or outside it (before it; after it without causal)
        # holding a summary key
        outside = (nf < jb) if self.causal else ((nf < jb) | (nf > jh))
        last = ((jb <= nf) & (nf <= jh)) | (outside & self.last_summary)
        if self.causal:
            right = 0
        else:
            right = self.summary_tiles(nf) - self.summary_tiles(np.maximum(hi_f + 1, lo_f))
        n_tiles = inner + left + right + last
        width = (inner + left + right) * bk + last * self.wk
        if self.cut:  # the diagonal tile stops at the row's last query
            jd = qe // bk
            dw = np.where(jd >= nf, self.wk, bk)
            width = width - np.where(jd <= g.n_kb - 1, dw - np.minimum(dw, qe + 1 - jd * bk), 0)
        return n_tiles.astype(np.int64), width.astype(np.int64)

    def count(self, rows: np.ndarray, hgt: int) -> tuple[int, int]:
        """``(tiles, score entries)`` summed over block rows ``rows`` of height ``hgt``."""
        t, w = self.per_row(rows, hgt)
        return int(t.sum()), int(w.sum()) * hgt


def _thresholds(g: Grid, f: Fixed, hgt: int) -> list[int]:
    """Block rows where a row's interval meets the last key tiles (its diagonal, its start or its
    block end crossing one of them): between two of these the rows repeat every period."""
    bq, bk, s = g.block_q, g.block_k, f.s
    out = [0, -(-(-(-g.kv_len // s) * s) // bq)]  # the first row whose own blocks start past the keys
    for x in (g.n_kb - 3, g.n_kb - 2, g.n_kb - 1, g.n_kb):
        if x < 0:
            continue
        out.append(-(-(x * bk - hgt + 1) // bq))  # first row whose diagonal tile is >= x
        u = -(-(x * bk) // s)
        out.append(-(-(u * s) // bq))  # first row whose interval starts at a tile >= x
        u = -(-(x * bk - s + 1) // s)
        out.append(-(-(u * s - hgt + 1) // bq))  # first row whose block end reaches tile x
    return out


def _sum_rows(rows_of: _Rows, a: int, b: int, hgt: int, period: int) -> tuple[int, int]:
    """Sum over block rows ``[a, b)``, where each row's count grows by a constant every ``period`` rows:
    two periods of rows give every residue's first value and step (a third one checks the step)."""
    if b - a <= 3 * period:
        return rows_of.count(np.arange(a, b, dtype=np.int64), hgt)
    tiles = width = 0
    for r0 in range(0, period, 1 << 16):  # residues in pieces: bounded memory
        r = np.arange(a + r0, a + min(period, r0 + (1 << 16)), dtype=np.int64)
        x0, x1, x2 = (rows_of.per_row(r + k * period, hgt) for k in range(3))
        for u, v, w in zip(x0, x1, x2):
            if not np.array_equal(w - v, v - u):
                raise Unsupported("fixed pattern rows that do not repeat (a counting bug: please report it)")
        m = (b - 1 - r) // period + 1  # rows a + rho, a + rho + period, ... below b: M or M + 1 of them
        for k, (u, v) in enumerate(zip(x0, x1)):
            total = 0
            for mm in (int(m.min()), int(m.max())) if m.min() != m.max() else (int(m[0]),):
                sel = m == mm  # sums of at most 2^16 values of at most kv_len each: exact in int64
                total += mm * int(u[sel].sum()) + (mm * (mm - 1) // 2) * int((v[sel] - u[sel]).sum())
            if k == 0:
                tiles += total
            else:
                width += total
    return tiles, width * hgt


def fixed_of(tree):
    """``(Fixed, ANDed with causal)`` when ``tree`` is a fixed pattern alone or ANDed with causal, else None."""
    if isinstance(tree, Fixed):
        return tree, False
    if isinstance(tree, And):
        for a, b in ((tree.a, tree.b), (tree.b, tree.a)):
            if isinstance(a, Fixed) and b == CAUSAL:
                return a, True
    return None


def count_fixed(grid: Grid, tree, *, causal_cut: bool = False) -> tuple[int, int]:
    """``(visited tiles, score entries inside them)`` of ``fixed(s, c)`` (or ``fixed(s, c) & causal``)
    on ``grid``, for any stride; raises ``Unsupported`` for any other tree."""
    found = fixed_of(tree)
    if found is None:
        raise Unsupported("not the fixed pattern alone")
    f, with_causal = found
    g = grid
    rows_of = _Rows(g, f, with_causal, causal_cut)
    L = lcm(f.s, g.block_k, g.block_q)
    period = L // g.block_q
    if period > MAX_PERIOD:
        raise Unsupported(f"fixed stride {f.s}: {period:,} block rows to a period")
    tiles = pairs = 0
    n_body = g.n_qb - 1  # full-height rows [0, n_body); the last row apart
    cuts = sorted({min(max(0, x), n_body) for x in _thresholds(g, f, g.block_q)} | {n_body})
    for a, b in zip(cuts, cuts[1:]):
        t, p = _sum_rows(rows_of, a, b, g.block_q, period)
        tiles, pairs = tiles + t, pairs + p
    hq = g.q_len - n_body * g.block_q
    t, p = rows_of.count(np.array([n_body], dtype=np.int64), hq)
    return tiles + t, pairs + p
