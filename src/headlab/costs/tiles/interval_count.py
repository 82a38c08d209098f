"""Counting the tiles a kernel visits without building its block map.

A block map has ``ceil(q_len / block_q) x ceil(kv_len / block_k)`` tiles: 3.8 * 10^9 for a causal
10^7-token call in 128 x 128 tiles, 6 * 10^19 at 10^12 tokens. The cost model needs only how many
tiles are visited (and, for the tiled backend, how many score entries they hold), and for the
built-in patterns that number has a closed form. This module computes it.

The idea, in three steps:

1. Tile ``(I, J)`` covers query rows ``[I bq, I bq + hgt)`` and key columns ``[J bk, J bk + wid)``.
   For a pattern that depends only on the offset ``d = q_idx - kv_idx`` (causal, windows, strided)
   the tile sees the offsets ``[I bq - J bk - (wid - 1), I bq - J bk + (hgt - 1)]``, so the key tiles
   it visits in block row ``I`` form an interval ``J in [floor((I bq + c1) / bk), floor((I bq + c2) / bk)]``.
   Global tokens and documents give intervals that are constant over runs of rows.
2. Rows are split by residue ``I = P m + r`` with ``P = bk / gcd(bq, bk)``: then every
   ``floor((I bq + c) / bk)`` is exactly affine in ``m`` (``m bq / gcd + floor((r bq + c) / bk)``), and
   every interval endpoint is an affine function :class:`Lin` of ``m``.
3. ``&``, ``|`` and ``~`` of interval sets only compare endpoints. Each comparison of two affine
   functions keeps its outcome up to a row it can compute; the count of one row, evaluated
   symbolically, is then a polynomial in ``m`` valid up to the first such row, and is summed over
   that run in closed form. A pattern takes a handful of runs, so any length costs microseconds.

A pattern this module cannot describe raises :class:`Unsupported`; the caller tries the next
counter (:mod:`headlab.costs.tiles.visited`). Correctness is checked against block maps for every built-in pattern and combination on
small lengths (``tests/test_costs.py``).
"""

from __future__ import annotations

from math import gcd

from headlab.costs.tiles.grid import Grid, Lin, Poly, Row, Run, Unsupported, rectangles

__all__ = ["WORK_BUDGET", "count_tiles"]

# Intervals handled for one count, at most (about a second): a pattern with thousands of separate
# global tokens or documents is left to the next counter (or refused) rather than counted for minutes.
WORK_BUDGET = 1 << 17


def count_tiles(grid: Grid, tree, *, causal_cut: bool = False) -> tuple[int, int]:
    """``(visited tiles, score entries inside them)`` of a pattern tree on ``grid``, per slice.

    ``tree`` is built by :mod:`headlab.costs.tiles.mask_tree` (its leaves give the tiles each block row
    visits; ``&``, ``|``, ``~`` combine them like block-map states: min, max, complement).
    ``causal_cut``: a tile's key range stops at its query block's end (the tiled kernel under
    ``causal=True``), so the entries of the diagonal tiles are counted cut.
    Raises :class:`Unsupported` where a leaf has no closed form.
    """
    g = grid
    n_qb, n_kb = g.n_qb, g.n_kb
    hq = g.q_len - (n_qb - 1) * g.block_q
    wk = g.kv_len - (n_kb - 1) * g.block_k
    P = g.block_k // gcd(g.block_q, g.block_k)
    row_classes = [(0, n_qb - 2, g.block_q), (n_qb - 1, n_qb - 1, hq)]
    col_classes = [(0, n_kb - 2, g.block_k), (n_kb - 1, n_kb - 1, wk)]
    breaks = sorted(set(tree.breaks(g)))
    if len(breaks) * P > WORK_BUDGET:  # at least one run of rows between two changes, per residue
        raise Unsupported(
            f"{len(breaks) * P:,} runs of block rows to follow (the pattern changes "
            f"{len(breaks):,} times along the rows)"
        )
    tiles = pairs2 = work = 0  # pairs2: twice the score entries (a cut tile's area has a half in it)
    for ia, ib, hgt, ja, jb, wid in rectangles(row_classes, col_classes):
        for r in range(P):
            m_lo, m_hi = -((r - ia) // P), (ib - r) // P + 1  # rows I = P m + r in [ia, ib]
            if m_hi <= m_lo:
                continue
            cuts = sorted({m_lo, m_hi, *(-((r - b) // P) for b in breaks if m_lo < -((r - b) // P) < m_hi)})
            for s, e in zip(cuts, cuts[1:]):
                while s < e:
                    run = Run(s, e)
                    row = Row(g, run, P, r, hgt, wid, Lin(0, ja), Lin(0, jb))
                    nonempty, _ = tree.sets(row, need_full=False)
                    n = Run.count(nonempty)
                    area2 = _cut_area2(row, nonempty) if causal_cut else n * (2 * hgt * wid)
                    tiles += n.sum_over(s, run.limit)
                    pairs2 += area2.sum_over(s, run.limit)
                    s = run.limit
                    work += run.work + len(nonempty) + 1
                    if work > WORK_BUDGET:
                        raise Unsupported(
                            f"more than {WORK_BUDGET:,} intervals of key tiles to follow "
                            f"over {len(breaks):,} changes of the pattern along the rows"
                        )
    return tiles, pairs2 // 2


def _cut_area2(row: Row, tiles) -> Poly:
    """Twice the score entries of ``tiles`` in one block row when key tiles stop at the row's last query."""
    run, hgt, wid, bk = row.run, row.hgt, row.wid, row.grid.block_k
    # key tiles from jc on end after the row's last query qe = qs + hgt - 1: width qe + 1 - J bk
    jc = row.band(hgt - wid + bk)
    whole = run.inter(tiles, [(row.j0, jc - 1)])
    cut = run.inter(tiles, [(jc, row.j1)])
    area = Run.count(whole) * (2 * wid)
    qe1 = Poly.of(row.qs()) + Poly((hgt,))  # qe + 1
    for lo, hi in cut:  # sum over J in [lo, hi] of qe + 1 - J bk, twice
        n = Poly.of(hi) - Poly.of(lo) + Poly((1,))
        area = area + n * qe1 * 2 - (Poly.of(lo) + Poly.of(hi)) * n * bk
    return area * hgt
