"""Patterns of the offset ``d = q_idx - kv_idx`` (full, causal, windows, dilated windows, strided) as
the tile counters see them.

A tile with ``hgt`` query rows and ``wid`` key columns whose first row and column differ by
``t = I bq - J bk`` sees the offsets ``R(t) = [t - (wid - 1), t + (hgt - 1)]``. Its state is decided
by ``R(t)`` alone, so an offset pattern answers two questions:

* :meth:`Offset.sets` (for :mod:`headlab.costs.tiles.interval_count`): the key tiles of one run of block rows
  that are non-empty / full, as intervals whose ends move linearly with the row. That needs every
  tile to see a visible offset of each band: dilations and strides no wider than a tile.
* :meth:`Offset.pieces` and :meth:`Offset.state_at` (for :mod:`headlab.costs.tiles.diagonal_count`): the
  visible offsets as *pieces* ``(a, b, s)``, the multiples of ``s`` in ``[a, b]`` (``s = 1``: all of
  them; ``None``: unbounded), and the state of ``R(t)`` against them, where "``R(t)`` holds a
  multiple of ``s``" may be left to the caller (it repeats every ``s`` offsets): any stride or
  dilation.
"""

from __future__ import annotations

from dataclasses import dataclass

from headlab.costs.tiles.grid import Grid, Row, Unsupported
from headlab.spec.tile_states import EMPTY, FULL, PARTIAL

__all__ = ["Node", "Offset", "leaf_state"]


class Node:
    """What every node of a tile-count tree answers; a leaf without an answer raises ``Unsupported``
    and the caller tries the next counter."""

    def sets(self, row: Row, need_full: bool):
        raise Unsupported(f"{type(self).__name__} has no interval form")

    def breaks(self, g: Grid) -> list[int]:
        return []

    def t_breaks(self, g: Grid, hgt: int, wid: int) -> list[int]:
        raise Unsupported(f"{type(self).__name__} is not a pattern of offsets or of runs of rows and columns")

    def cuts(self, g: Grid) -> tuple[list[int], list[int]]:
        """Block rows and key tiles where this node's state (outside of offsets) can change."""
        return [], []

    def state_at(self, ctx) -> int:
        raise Unsupported(f"{type(self).__name__} is not a pattern of offsets or of runs of rows and columns")


def band_sets(row: Row, lo: int | None, hi: int | None):
    """Key tiles of the block row that see some / only offsets in ``[lo, hi]`` (None: unbounded).

    A tile sees the offsets ``[t - (wid - 1), t + (hgt - 1)]`` with ``t = I bq - J bk``.
    """
    bk, hgt, wid = row.grid.block_k, row.hgt, row.wid
    # non-empty: t - (wid - 1) <= hi and t + hgt - 1 >= lo
    ne_lo = row.j0 if hi is None else row.band(bk - wid - hi)  # J >= ceil((I bq - wid + 1 - hi) / bk)
    ne_hi = row.j1 if lo is None else row.band(hgt - 1 - lo)  # J <= floor((I bq + hgt - 1 - lo) / bk)
    # full: t - (wid - 1) >= lo and t + hgt - 1 <= hi
    f_lo = row.j0 if hi is None else row.band(hgt - 1 - hi + bk - 1)
    f_hi = row.j1 if lo is None else row.band(1 - wid - lo)
    run = row.run
    clip = row.all()
    return run.inter([(ne_lo, ne_hi)], clip), run.inter([(f_lo, f_hi)], clip)


def _union_all(row: Row, sets):
    out: list = []
    for s in sets:
        out = row.run.union(out, s)
    return out


def leaf_state(pieces, t: int, hgt: int, wid: int, hit) -> int:
    """State of a tile seeing the offsets ``R = [t - wid + 1, t + hgt - 1]`` under disjoint pieces
    ``(a, b, s)``. ``hit(s)`` answers whether ``R`` holds a multiple of ``s`` when ``R`` lies strictly
    inside a piece of step ``s`` (elsewhere the answer follows from where the piece's ends fall)."""
    rlo, rhi = t - wid + 1, t + hgt - 1
    seen, all_seen, covered = False, True, 0
    for a, b, s in pieces:
        lo = rlo if a is None else max(rlo, a)
        hi = rhi if b is None else min(rhi, b)
        if lo > hi:
            continue
        covered += hi - lo + 1
        if s == 1:
            seen = True
        elif (a is not None and lo == a) or (b is not None and hi == b):  # an end (a multiple) is in R
            seen = True
            all_seen = all_seen and lo == hi
        else:  # R strictly inside the piece: whether it holds a multiple repeats every s offsets
            h = hit(s)
            seen = seen or h
            all_seen = all_seen and lo == hi and h
    if not seen:
        return EMPTY
    return FULL if all_seen and covered == rhi - rlo + 1 else PARTIAL


@dataclass(frozen=True)
class Offset(Node):
    """A pattern visible on offset intervals: ``bands`` of ``(lo, hi)`` (None: unbounded)."""

    bands: tuple  # ((lo, hi), ...): disjoint and not adjacent (so FULL tiles lie inside one)
    dilation: int = 1  # visible offsets inside a band are the multiples of this
    strided: int = 0  # > 0: every multiple of this beyond the bands is visible too (strided pattern)
    kv_minus_q: bool = False  # causal_lower_right: the band is shifted by kv_len - q_len

    # -- for interval_count: intervals of key tiles per run of block rows ----------------------------
    def sets(self, row: Row, need_full: bool):
        span = row.hgt + row.wid - 1  # offsets seen by one tile
        shift = row.grid.kv_len - row.grid.q_len if self.kv_minus_q else 0
        bands = [(None if lo is None else lo - shift, None if hi is None else hi - shift) for lo, hi in self.bands]
        if self.dilation > 1:
            if span < self.dilation:  # a tile can fall between two visible offsets: periodic, not a band
                raise Unsupported(f"dilation {self.dilation} is wider than a tile's offsets ({span})")
            # every interval of >= dilation offsets holds a multiple; the band's ends are multiples
            if span > 1:
                ne = [band_sets(row, lo, hi)[0] for lo, hi in bands]
                return _union_all(row, ne), ([] if need_full else None)
        if self.strided:
            s = self.strided
            if span < s:
                raise Unsupported(f"stride {s} is wider than a tile's offsets ({span})")
            # every tile that reaches past the local band holds a multiple of the stride
            causal = bands[0][0] == 0  # strided(s): d >= 0; strided(s, non-causal): every d
            ne, full = band_sets(row, 0 if causal else None, None)
            if s == 1:  # every offset (every offset >= 0) is a multiple of 1
                return ne, full
            if span == 1 and need_full:
                raise Unsupported("full tiles of a strided pattern on 1x1 tiles")
            # a tile holding two consecutive offsets beyond the local band holds a hidden one
            return ne, band_sets(row, *bands[0])[1]
        parts = [band_sets(row, lo, hi) for lo, hi in bands]
        return _union_all(row, [p[0] for p in parts]), _union_all(row, [p[1] for p in parts])

    # -- for diagonals: the visible offsets as pieces, and the state of one tile's offsets -------
    def pieces(self, g: Grid) -> list[tuple[int | None, int | None, int]]:
        if self.strided:
            s = self.strided
            causal = self.bands[0][0] == 0
            if s == 1:
                return [(0 if causal else None, None, 1)]
            # the local band, then the multiples of s beyond it (s itself is in the band)
            out: list[tuple[int | None, int | None, int]] = [(0, s, 1) if causal else (-s, s, 1), (2 * s, None, s)]
            return out if causal else [(None, -2 * s, s), *out]
        shift = g.kv_len - g.q_len if self.kv_minus_q else 0
        return [
            (None if lo is None else lo - shift, None if hi is None else hi - shift, self.dilation)
            for lo, hi in self.bands
        ]  # a dilated band's ends are multiples of the dilation

    def t_breaks(self, g: Grid, hgt: int, wid: int) -> list[int]:
        """Values of ``t`` where ``R(t)`` starts or stops holding a piece's end, or holds only it."""
        out = []
        for a, b, _ in self.pieces(g):
            for e in (a, b):
                if e is not None:
                    out += [e - hgt + 1, e - hgt + 2, e + wid - 1, e + wid]
        return out

    def state_at(self, ctx) -> int:
        return leaf_state(self.pieces(ctx.grid), ctx.t, ctx.hgt, ctx.wid, ctx.hit)
