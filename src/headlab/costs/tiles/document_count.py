"""Counting the tiles of packed documents (``documents``), alone or ANDed with a band of offsets
(``causal``, a sliding window, both), vectorised over the documents.

Block row ``I`` sees the key tiles ``[C0, C1]`` of the documents its queries fall in (constant over
the rows between two document edges), cut by the band ``lo <= q - kv <= hi``:
``[F0(I), F1(I)] = [floor((I bq - hi) / bk), floor((I bq + hgt - 1 - lo) / bk)]``. Both ends of the
band move with the row, so a run of rows splits into at most five zones (band left of, across, inside,
around, right of the documents' tiles) where the count is a constant or a sum of ``floor((I bq + c) / bk)``;
those sums come from a table of one period of rows (``bk / gcd(bq, bk)`` rows), for every run at
once. Under the tiled kernel's causal cut (``lo = 0``), the diagonal tile of each row is cut at the
row's last query: ``bk - 1 - (qe mod bk)`` entries fewer, summed the same way.

The work is a few array operations per document, whatever the length (10^5 documents in 10^8
tokens: tens of milliseconds). Other trees raise ``Unsupported``.
"""

from __future__ import annotations

from math import gcd

import numpy as np

from headlab.costs.tiles.grid import Grid, Unsupported
from headlab.costs.tiles.logic_nodes import And
from headlab.costs.tiles.offset_nodes import Offset
from headlab.costs.tiles.run_nodes import Documents

__all__ = ["count_documents"]

_BIG = 1 << 60
_CHUNK = 1 << 14  # runs of rows counted at once (bounded temporaries)


def _band(tree) -> tuple[int, int] | None:
    """``(lo, hi)`` of a tree of offset bands ANDed together (``+-_BIG``: unbounded), or None."""
    if isinstance(tree, And):
        a, b = _band(tree.a), _band(tree.b)
        return None if a is None or b is None else (max(a[0], b[0]), min(a[1], b[1]))
    if isinstance(tree, Offset) and len(tree.bands) == 1 and tree.dilation == 1 and not tree.strided:
        lo, hi = tree.bands[0]  # causal_lower_right's shift is 0: documents need q_len == kv_len
        return (-_BIG if lo is None else lo, _BIG if hi is None else hi)
    return None


def _documents_of(tree):
    """``(Documents, (lo, hi))`` for documents alone or ANDed with bands, else None."""
    if isinstance(tree, Documents):
        return tree, (-_BIG, _BIG)
    if not isinstance(tree, And):
        return None
    for a, b in ((tree.a, tree.b), (tree.b, tree.a)):
        found = _documents_of(a)
        band = _band(b)
        if found is not None and band is not None:
            (lo0, hi0), (lo1, hi1) = found[1], band
            return found[0], (max(lo0, lo1), min(hi0, hi1))
    return None


class _Floors:
    """``sum_{i=0}^{n-1} floor((i bq + c) / bk)`` for arrays ``n >= 0`` and ``c``, from a table of one period."""

    def __init__(self, bq: int, bk: int, dtype):
        g = gcd(bq, bk)
        self.bq, self.bk, self.per, self.step, self.dtype = bq, bk, bk // g, bq // g, dtype
        i = np.arange(self.per, dtype=np.int64)
        vals = (i[None, :] * bq + np.arange(bk, dtype=np.int64)[:, None]) // bk  # (bk, per)
        self.table = np.concatenate([np.zeros((bk, 1), dtype=np.int64), np.cumsum(vals, 1)], 1).astype(dtype)

    def __call__(self, n, c):
        q0, k = c // self.bk, n // self.per  # (// and % work on Python-int arrays too)
        r, rho = c - q0 * self.bk, n - k * self.per
        r = r.astype(np.int64)
        rho = rho.astype(np.int64)
        t = self.table
        return n * q0 + k * t[r, self.per] + self.per * self.step * (k * (k - 1) // 2) + t[r, rho] + rho * k * self.step


def _first(x, bq: int, bk: int, c):
    """First block row ``I`` with ``floor((I bq + c) / bk) >= x`` (arrays)."""
    return -((c - x * bk) // bq)


def _runs(g: Grid, docs: Documents):
    """Starts of the runs of full-height block rows between document edges, and the run ends."""
    edges = np.asarray(docs.ends[:-1], dtype=np.int64)
    cuts = np.concatenate(([0, g.n_qb - 1], edges // g.block_q, edges // g.block_q + 1))
    cuts = np.unique(cuts[(cuts >= 0) & (cuts <= g.n_qb - 1)])
    return cuts[:-1], cuts[1:]


def _count(g: Grid, docs: Documents, band, r0, r1, hgt: int, cut: bool, dtype) -> tuple[int, int]:
    bq, bk = g.block_q, g.block_k
    lo, hi = band
    ends = np.asarray(docs.ends, dtype=np.int64)
    nf = g.n_kb - 1  # full-width key tiles [0, nf); the last one, nf, is wk wide
    wk = g.kv_len - nf * bk
    r0, r1 = r0.astype(dtype), r1.astype(dtype)
    qs = r0 * bq
    d0 = np.searchsorted(ends, qs.astype(np.int64), "right")  # the documents of the run's rows
    d1 = np.searchsorted(ends, (qs + hgt - 1).astype(np.int64), "right")
    starts = np.concatenate(([0], ends))
    c0 = (starts[d0] // bk).astype(dtype)  # key tiles [c0, c1] of those documents
    c1 = ((ends[d1] - 1) // bk).astype(dtype)
    c1f = np.minimum(c1, nf - 1)
    floors = _Floors(bq, bk, dtype)

    def fsum(a, b, c):  # sum of floor((I bq + c) / bk) over rows I in [a, b) (empty when b <= a)
        n = np.maximum(b - a, 0)
        return floors(n, a * bq + c)

    def clip(x):
        return np.minimum(np.maximum(x, r0), r1)

    unb_lo, unb_hi = lo <= -_BIG // 2, hi >= _BIG // 2
    # F1(I) = floor((I bq + hgt - 1 - lo) / bk) (unbounded: above every tile), F0(I) = floor((I bq - hi) / bk)
    c_hi, c_lo = hgt - 1 - lo, -hi
    a = r0 if unb_lo else clip(_first(c0, bq, bk, c_hi))  # F1 >= c0 from here: the band meets the documents
    b = r0 if unb_lo else clip(_first(c1f + 1, bq, bk, c_hi))  # F1 > c1f from here: upper end c1f
    c = r1 if unb_hi else clip(_first(c0 + 1, bq, bk, c_lo))  # F0 > c0 from here: lower end F0
    e = r1 if unb_hi else clip(_first(c1f + 1, bq, bk, c_lo))  # F0 > c1f from here: nothing any more
    u, v = a, np.maximum(a, e)  # rows whose count is min(c1f, F1) - max(c0, F0) + 1
    upper = c1f * np.maximum(v - np.maximum(u, b), 0)
    lower = c0 * np.maximum(np.minimum(v, c) - u, 0)
    if not unb_lo:
        upper = upper + fsum(u, np.minimum(v, b), c_hi)
    if not unb_hi:
        lower = lower + fsum(np.maximum(u, c), v, c_lo)
    full = np.where(c0 <= c1f, upper - lower + (v - u), 0)
    # the last key tile: its documents' tiles reach it, and the band meets it (t = I bq - nf bk)
    last_lo = r0 if unb_lo else clip(_first(nf, bq, bk, c_hi))
    last_hi = r1 if unb_hi else clip((nf * bk + wk - 1 + hi) // bq + 1)
    last = np.where(c1 >= nf, np.maximum(last_hi - last_lo, 0), 0)
    tiles = int(sum(full.tolist())) + int(sum(last.tolist()))
    width = bk * int(sum(full.tolist())) + wk * int(sum(last.tolist()))
    if cut:  # causal (lo = 0): the diagonal tile d(I) = F1(I) of a row is cut at its last query
        ra, rc = clip(_first(c0, bq, bk, hgt - 1)), clip(_first(c1f + 1, bq, bk, hgt - 1))
        n = np.maximum(rc - ra, 0)
        qe_sum = n * (ra * bq + hgt - 1) + bq * (n * (n - 1) // 2)
        mods = qe_sum - bk * fsum(ra, rc, hgt - 1)  # sum of qe mod bk over those rows
        removed = int(sum(((bk - 1) * n - mods).tolist()))
        for i0, i1, top in zip(r0.tolist(), r1.tolist(), c1.tolist()):  # rows whose diagonal is the last tile
            if top < nf:
                continue
            first = max(i0, -((hgt - 1 - nf * bk) // bq))
            for i in range(first, min(i1, -((hgt - 1 - (nf + 1) * bk) // bq))):
                removed += max(0, g.kv_len - 1 - (i * bq + hgt - 1))
        width -= removed
    return tiles, width * hgt


def count_documents(grid: Grid, tree, *, causal_cut: bool = False) -> tuple[int, int]:
    """``(visited tiles, score entries inside them)`` of documents (``&`` bands) on ``grid``."""
    found = _documents_of(tree)
    if found is None:
        raise Unsupported("not documents alone or with bands")
    docs, band = found
    if causal_cut and band[0] != 0:
        raise Unsupported("a causal cut against a band that does not start at the diagonal")
    g = grid
    docs._check(g)
    if band[0] > band[1]:
        return 0, 0
    r0, r1 = _runs(g, docs)
    hq = g.q_len - (g.n_qb - 1) * g.block_q
    last = np.array([g.n_qb - 1], dtype=np.int64)
    tiles = pairs = 0
    for k in range(0, len(r0), _CHUNK):
        a, b = r0[k : k + _CHUNK], r1[k : k + _CHUNK]
        t, p = _count(g, docs, band, a, b, g.block_q, causal_cut, _dtype(g, int((b - a).max())))
        tiles, pairs = tiles + t, pairs + p
    t, p = _count(g, docs, band, last, last + 1, hq, causal_cut, _dtype(g, 1))
    return tiles + t, pairs + p


def _dtype(g: Grid, rows: int):
    """int64 when every intermediate of a run of ``rows`` block rows fits (each is at most about
    ``rows * (positions + bq * rows)``), else exact Python integers."""
    big = rows * (g.q_len + g.kv_len + g.block_q * rows + g.n_kb) * 4
    return np.int64 if big < (1 << 62) else object
