"""Counting the tiles of a block layout (``block_layout``), alone or with causal, from its cells.

A layout of ``cq x ck`` cells is constant on runs of block rows: the tile rows touching the same
cell rows see the OR of those cell rows, whose runs of on cells cover intervals of key tiles. This
counts each such run of block rows at once (its interval lengths times its rows), and under causal
clips the intervals at the diagonal tile ``d(I) = floor((I bq + hgt - 1) / bk)``, which moves
linearly with the row: the rows where ``d`` crosses an interval are summed with floor sums, and so
are the diagonal tiles the tiled kernel cuts. The work is about the layout's own size, whatever the
length (a 1000 x 1000 layout of 10^9-position cells, 10^12 tokens: milliseconds).

The tile counters of :mod:`headlab.costs.tiles.interval_count` read layouts in any composition but work per
interval; this one reads a layout alone (one slice, or the tiled kernel's union over heads) or
ANDed with causal, and raises ``Unsupported`` otherwise.
"""

from __future__ import annotations

import numpy as np

from headlab.costs.tiles.floor_sums import floor_sums
from headlab.costs.tiles.grid import Grid, Unsupported
from headlab.costs.tiles.logic_nodes import CAUSAL, And, Combine
from headlab.costs.tiles.run_nodes import Layout

__all__ = ["count_layout"]


def _layout_of(tree):
    """``(cells, cell, with causal)`` of a layout tree (heads combined by OR: the tiled kernel visits
    a tile any head visits), or None."""
    causal = False
    if isinstance(tree, And) and CAUSAL in (tree.a, tree.b):
        tree, causal = (tree.b if tree.a == CAUSAL else tree.a), True
    parts = tree.parts if isinstance(tree, Combine) else (tree,)
    if not parts or not all(isinstance(p, Layout) and p.cell == parts[0].cell for p in parts):
        return None
    cells = parts[0].cells
    for p in parts[1:]:
        cells = cells | p.cells
    return cells, parts[0], causal


def _row_runs(g: Grid, layout: Layout):
    """Runs ``(I0, I1, hgt, c0, c1)`` of block rows of one height touching the cell rows ``[c0, c1]``."""
    cq = layout.cell[0]
    hq = g.q_len - (g.n_qb - 1) * g.block_q
    cuts = {0, g.n_qb - 1, g.n_qb, *(b for b in layout.breaks(g) if 0 < b < g.n_qb)}
    edges = sorted(cuts)
    for i0, i1 in zip(edges, edges[1:]):
        hgt = hq if i0 == g.n_qb - 1 else g.block_q
        qs = i0 * g.block_q
        yield i0, i1, hgt, qs // cq, (qs + hgt - 1) // cq


def _segments(on: np.ndarray, ck: int, g: Grid) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted intervals ``[s, e]`` of key tiles holding an on cell of the row ``on``."""
    flag = np.concatenate(([False], on, [False]))
    a = np.flatnonzero(~flag[:-1] & flag[1:])  # runs of on cells [a, b]
    b = np.flatnonzero(flag[:-1] & ~flag[1:]) - 1
    lo = (a * ck) // g.block_k
    hi = (np.minimum((b + 1) * ck, g.kv_len) - 1) // g.block_k
    prev = np.concatenate(([-1], np.maximum.accumulate(hi)[:-1])) if len(hi) else hi
    s = np.maximum(lo, prev + 1)  # the tiles interval k adds to those before it
    keep = s <= hi
    return s[keep], hi[keep]


def _first_row(x: int, bq: int, bk: int, hgt: int) -> int:
    """The first block row whose diagonal tile is at least ``x``."""
    return -(-(x * bk - hgt + 1) // bq)


def _diag_sum(i0: int, i1: int, bq: int, bk: int, hgt: int) -> tuple[int, int]:
    """``(sum d(I), sum (I bq + hgt - 1) mod bk)`` over block rows ``[i0, i1)``."""
    n = i1 - i0
    if n <= 0:
        return 0, 0
    f, _ = floor_sums(n, bq, i0 * bq + hgt - 1, bk)
    x = n * (i0 * bq + hgt - 1) + bq * n * (n - 1) // 2  # sum of I bq + hgt - 1
    return f, x - bk * f


def count_layout(grid: Grid, tree, *, causal_cut: bool = False) -> tuple[int, int]:
    """``(visited tiles, score entries inside them)`` of a layout (``& causal``) on ``grid``."""
    found = _layout_of(tree)
    if found is None:
        raise Unsupported("not a block layout alone")
    cells, layout, causal = found
    g = grid
    layout._check(g)
    bq, bk, ck = g.block_q, g.block_k, layout.cell[1]
    nf = g.n_kb - 1  # key tiles [0, nf) are full width; tile nf is the last one
    wk = g.kv_len - nf * bk
    tiles = pairs = 0
    for i0, i1, hgt, c0, c1 in _row_runs(g, layout):
        n = i1 - i0
        s, e = _segments(cells[c0 : c1 + 1].any(0), ck, g)
        last_on = bool(len(e) and e[-1] == nf)
        e = np.minimum(e, nf - 1)  # full-width tiles [s, e]
        keep = s <= e
        s, e = s[keep], e[keep]
        if not causal:
            full_tiles = int((e - s + 1).sum())
            tiles += n * (full_tiles + last_on)
            pairs += n * hgt * (full_tiles * bk + last_on * wk)
            continue
        d0, d1 = (i0 * bq + hgt - 1) // bk, ((i1 - 1) * bq + hgt - 1) // bk  # the diagonal tiles of the run
        below = e < d0  # left of every row's diagonal: whole in every row, never cut
        full_tiles = n * int((e[below] - s[below] + 1).sum())
        cut = 0  # entries the diagonal cut removes, over the rows
        cross = ~below & (s <= d1)  # met by some row's diagonal (those right of it are never visited)
        for a, b in zip(s[cross].tolist(), e[cross].tolist()):
            ra, rb = max(i0, _first_row(a, bq, bk, hgt)), max(i0, _first_row(b, bq, bk, hgt))
            ra, rb = min(ra, i1), min(rb, i1)
            dsum, _ = _diag_sum(ra, rb, bq, bk, hgt)  # rows whose diagonal is inside [a, b)
            full_tiles += dsum - (a - 1) * (rb - ra) + (b - a + 1) * (i1 - rb)
            if causal_cut:  # rows whose diagonal tile is one of [a, b]: it is cut at the row's last query
                rc = min(i1, max(i0, _first_row(b + 1, bq, bk, hgt)))
                _, mods = _diag_sum(ra, rc, bq, bk, hgt)
                cut += (bk - 1) * (rc - ra) - mods
        last_rows = max(0, i1 - max(i0, _first_row(nf, bq, bk, hgt))) if last_on else 0
        if causal_cut and last_on:
            for i in range(max(i0, _first_row(nf, bq, bk, hgt)), min(i1, _first_row(nf + 1, bq, bk, hgt))):
                cut += max(0, g.kv_len - 1 - (i * bq + hgt - 1))  # the last tile cut at the row's last query
        tiles += full_tiles + last_rows
        pairs += hgt * (full_tiles * bk + last_rows * wk - cut)
    return tiles, pairs
