"""Patterns constant over runs of block rows and key tiles: global tokens, documents, padding, block
layouts (cells of a fixed size), as the tile counters see them.

Each answers :meth:`sets` (for :mod:`headlab.costs.tiles.interval_count`: the key tiles of a run of block rows,
constant intervals) and :meth:`cuts` / :meth:`state_at` (for :mod:`headlab.costs.tiles.diagonal_count`: the block
rows and key tiles where its state can change, and its state on one rectangle between them), exactly
as the mask's own block classifier states them.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from headlab.costs.tiles.grid import Grid, Lin, Row, Unsupported
from headlab.costs.tiles.offset_nodes import Node
from headlab.errors import MaskError
from headlab.spec.tile_states import EMPTY, FULL, PARTIAL

__all__ = ["Documents", "Global", "KeyPrefix", "Layout", "runs_of"]

MAX_CELLS = 1 << 24  # a layout with more cells than this is streamed, not read run by run


def runs_of(sorted_pos) -> tuple[tuple[int, int], ...]:
    """Maximal runs ``(a, b)`` of consecutive positions in a sorted list of distinct positions."""
    out: list[list[int]] = []
    for p in sorted_pos:
        if out and p == out[-1][1] + 1:
            out[-1][1] = p
        else:
            out.append([p, p])
    return tuple((a, b) for a, b in out)


class _Runs(Node):
    """A node whose state does not depend on offsets: constant on rectangles between its cuts."""

    def t_breaks(self, g: Grid, hgt: int, wid: int) -> list[int]:
        return []


def _state(full: bool, some: bool) -> int:
    return FULL if full else (PARTIAL if some else EMPTY)


def _edge_cuts(points, block: int, n: int) -> list[int]:
    """Tile indices around each position in ``points`` (for tiles of ``block``, ``n`` positions)."""
    out = []
    for p in points:
        if 0 <= p <= n:
            out += [p // block - 1, p // block, p // block + 1, p // block + 2]
    return out


@lru_cache(maxsize=64)
def _global_cols(runs: tuple, kv_len: int, bk: int, wid: int, ja: int, jb: int):
    """Key tiles in ``[ja, jb]`` (each ``wid`` wide) holding a global key / only global keys, as
    constant intervals (the same for every block row: computed once per tile class)."""
    ne: list[list[int]] = []
    full: list[list[int]] = []
    for a, b in runs:
        if a >= kv_len:
            break
        b = min(b, kv_len - 1)
        for out, lo, hi in (
            (ne, max(ja, a // bk), min(jb, b // bk)),
            (full, max(ja, -(-a // bk)), min(jb, (b - wid + 1) // bk)),
        ):
            if lo > hi:
                continue
            if out and lo <= out[-1][1] + 1:
                out[-1][1] = max(out[-1][1], hi)
            else:
                out.append([lo, hi])
    return [(Lin(0, a), Lin(0, b)) for a, b in ne], [(Lin(0, a), Lin(0, b)) for a, b in full]


@dataclass(frozen=True)
class Global(_Runs):
    """``global_tokens(indices)``: global rows see every key, every row sees global columns."""

    runs: tuple  # ((a, b), ...): sorted runs of consecutive global positions
    _below: tuple = field(default=(), compare=False, repr=False)  # global positions before each run

    def __post_init__(self):
        acc, out = 0, []
        for a, b in self.runs:
            out.append(acc)
            acc += b - a + 1
        object.__setattr__(self, "_below", tuple(out))

    def count(self, lo: int, hi: int) -> int:
        """Global positions in ``[lo, hi]``."""
        return self._upto(hi + 1) - self._upto(lo)

    def _upto(self, x: int) -> int:  # global positions < x
        k = bisect_right([a for a, _ in self.runs], x - 1) - 1 if self.runs else -1
        if k < 0:
            return 0
        a, b = self.runs[k]
        return self._below[k] + min(x, b + 1) - a

    def sets(self, row: Row, need_full: bool):
        g = row.grid
        qs = row.row * g.block_q
        n_global_rows = self.count(qs, qs + row.hgt - 1)
        ne_c, full_c = _global_cols(self.runs, g.kv_len, g.block_k, row.wid, row.j0.b, row.j1.b)
        if n_global_rows == row.hgt:
            return row.all(), row.all()
        if n_global_rows:
            return row.all(), full_c
        return ne_c, full_c

    def breaks(self, g: Grid):
        out = []
        for a, b in self.runs:
            for p in (a, b):
                if p < g.q_len:
                    out += [p // g.block_q, p // g.block_q + 1]
        return out

    def cuts(self, g: Grid):
        ends = [p for a, b in self.runs for p in (a, b + 1)]
        return _edge_cuts(ends, g.block_q, g.q_len), _edge_cuts(ends, g.block_k, g.kv_len)

    def state_at(self, ctx) -> int:
        g = ctx.grid
        qs, ks = ctx.I * g.block_q, ctx.J * g.block_k
        nq, nk = self.count(qs, qs + ctx.hgt - 1), self.count(ks, ks + ctx.wid - 1)
        return max(_state(nq == ctx.hgt, nq > 0), _state(nk == ctx.wid, nk > 0))


@dataclass(frozen=True)
class Documents(_Runs):
    """``documents(lengths)``: a query sees the keys of its own document."""

    ends: tuple  # exclusive end of each document, increasing

    def _check(self, g: Grid):
        if g.q_len != self.ends[-1] or g.kv_len != self.ends[-1]:  # what the mask itself says when evaluated
            raise MaskError(
                f"documents of {len(self.ends):,} lengths cover {self.ends[-1]:,} positions but the call "
                f"has q_len={g.q_len}, kv_len={g.kv_len}; the lengths must add up to the sequence length"
            )

    def sets(self, row: Row, need_full: bool):
        g = row.grid
        self._check(g)
        bk, wid = g.block_k, row.wid
        qs = row.row * g.block_q
        qe = qs + row.hgt - 1
        d0, d1 = bisect_right(self.ends, qs), bisect_right(self.ends, qe)
        start = self.ends[d0 - 1] if d0 else 0
        last = self.ends[d1] - 1
        ne = row.run.inter([(row.const(start // bk), row.const(last // bk))], row.all())
        full = []
        if d0 == d1:
            full = row.run.inter([(row.const(-(-start // bk)), row.const((last - wid + 1) // bk))], row.all())
        return ne, full

    def breaks(self, g: Grid):
        out = [0]
        for p in self.ends[:-1]:
            out += [p // g.block_q, p // g.block_q + 1]
        return out

    def cuts(self, g: Grid):
        self._check(g)
        return _edge_cuts(self.ends[:-1], g.block_q, g.q_len), _edge_cuts(self.ends[:-1], g.block_k, g.kv_len)

    def state_at(self, ctx) -> int:
        g = ctx.grid
        qs, ks = ctx.I * g.block_q, ctx.J * g.block_k
        dq0, dq1 = bisect_right(self.ends, qs), bisect_right(self.ends, qs + ctx.hgt - 1)
        dk0, dk1 = bisect_right(self.ends, ks), bisect_right(self.ends, ks + ctx.wid - 1)
        return _state(dq0 == dq1 == dk0 == dk1, dq0 <= dk1 and dk0 <= dq1)


@dataclass(frozen=True)
class KeyPrefix(_Runs):
    """``padding(lengths)`` for one batch element: the keys before ``n`` are visible to every query."""

    n: int

    def sets(self, row: Row, need_full: bool):
        bk = row.grid.block_k
        ne = row.run.inter([(row.j0, row.const((self.n - 1) // bk))], row.all()) if self.n > 0 else []
        full = row.run.inter([(row.j0, row.const((self.n - row.wid) // bk))], row.all())
        return ne, full

    def cuts(self, g: Grid):
        return [], _edge_cuts(
            [self.n, self.n - g.block_k, self.n - (g.kv_len - (g.n_kb - 1) * g.block_k)], g.block_k, g.kv_len
        )

    def state_at(self, ctx) -> int:
        ks = ctx.J * ctx.grid.block_k
        return _state(ks + ctx.wid - 1 < self.n, ks < self.n)


class Layout(_Runs):
    """A block layout of cells (``block_layout``; one head of it): a tile is FULL when every cell it
    touches is on, EMPTY when none is. ``cell = (rows, columns)`` positions per cell."""

    def __init__(self, cells: np.ndarray, cell: tuple[int, int], key):
        self.cells = cells  # bool (n_q_cells, n_kv_cells)
        self.cell = cell
        self.key = key  # identifies the layout (hash and equality)
        self._rows: dict = {}

    def __eq__(self, other):
        return isinstance(other, Layout) and other.key == self.key

    def __hash__(self):
        return hash(self.key)

    def _check(self, g: Grid):
        want = (-(-g.q_len // self.cell[0]), -(-g.kv_len // self.cell[1]))
        if self.cells.shape != want:  # what the mask itself says when evaluated
            raise MaskError(
                f"block_layout has {self.cells.shape[0]} x {self.cells.shape[1]} blocks of "
                f"{self.cell[0]} x {self.cell[1]} but the call needs {want[0]} x {want[1]} "
                f"(ceil(q_len / {self.cell[0]}) x ceil(kv_len / {self.cell[1]})); build the layout "
                "for this length"
            )
        if self.cells.size > MAX_CELLS:
            raise Unsupported(f"a layout of {self.cells.size:,} cells")

    def _cell_rows(self, g: Grid, qs: int, hgt: int):
        return qs // self.cell[0], (qs + hgt - 1) // self.cell[0]

    def _columns(self, g: Grid, c0: int, c1: int, wid: int, ja: int, jb: int):
        """(non-empty, full) key tiles of ``[ja, jb]`` for the cell rows ``[c0, c1]``: constant intervals."""
        key = (c0, c1, wid, ja, jb)
        got = self._rows.get(key)
        if got is None:
            part = self.cells[c0 : c1 + 1]
            ck, bk = self.cell[1], g.block_k
            out = []
            for on in (part.any(0), part.all(0)):
                flag = np.concatenate(([False], on, [False]))
                starts = np.flatnonzero(~flag[:-1] & flag[1:])  # runs of on cells [a, b]
                ends = np.flatnonzero(flag[:-1] & ~flag[1:]) - 1
                out.append((starts, ends))
            runs_ne = zip(out[0][0].tolist(), out[0][1].tolist())  # Python ints: the ends grow past int64
            runs_full = zip(out[1][0].tolist(), out[1][1].tolist())
            ne = [(max(ja, a * ck // bk), min(jb, (min((b + 1) * ck, g.kv_len) - 1) // bk)) for a, b in runs_ne]
            full = [
                (max(ja, -(-(a * ck) // bk)), min(jb, (min((b + 1) * ck, g.kv_len) - wid) // bk)) for a, b in runs_full
            ]
            got = self._rows[key] = tuple([(lo, hi) for lo, hi in iv if lo <= hi] for iv in (ne, full))
        return got

    def sets(self, row: Row, need_full: bool):
        g = row.grid
        self._check(g)
        c0, c1 = self._cell_rows(g, row.row * g.block_q, row.hgt)
        ne, full = self._columns(g, c0, c1, row.wid, row.j0.b, row.j1.b)
        return (
            row.run.norm([(Lin(0, a), Lin(0, b)) for a, b in ne]),  # runs of cells can share a tile
            row.run.norm([(Lin(0, a), Lin(0, b)) for a, b in full]) if need_full else None,
        )

    def breaks(self, g: Grid):
        self._check(g)
        hq = g.q_len - (g.n_qb - 1) * g.block_q
        out = []
        for c in range(1, self.cells.shape[0]):
            p = c * self.cell[0]
            out += [p // g.block_q, p // g.block_q + 1, (p - hq) // g.block_q + 1, (p - g.block_q) // g.block_q + 1]
        return out

    def cuts(self, g: Grid):
        self._check(g)
        if self.cells.size > 4096:
            raise Unsupported(f"a layout of {self.cells.size:,} cells against offsets")
        rows = [c * self.cell[0] for c in range(self.cells.shape[0] + 1)]
        cols = [c * self.cell[1] for c in range(self.cells.shape[1] + 1)]
        return _edge_cuts(rows, g.block_q, g.q_len), _edge_cuts(cols, g.block_k, g.kv_len)

    def state_at(self, ctx) -> int:
        g = ctx.grid
        c0, c1 = self._cell_rows(g, ctx.I * g.block_q, ctx.hgt)
        ks = ctx.J * g.block_k
        part = self.cells[c0 : c1 + 1, ks // self.cell[1] : (ks + ctx.wid - 1) // self.cell[1] + 1]
        return _state(bool(part.all()), bool(part.any()))
