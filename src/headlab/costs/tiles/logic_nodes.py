"""How the tile counters combine nodes: ``&``, ``|``, ``~`` of patterns and the slices of one mask.

``&`` / ``|`` / ``~`` combine per-tile states as block maps do (min, max, FULL <-> EMPTY), for the
interval counter (:meth:`sets`: intersection, union, complement of the FULL tiles) and the diagonal
counter (:meth:`state_at`). :class:`Combine` merges the slices of a mask as the tiled kernel does.
"""

from __future__ import annotations

from dataclasses import dataclass

from headlab.costs.tiles.grid import Grid, Row
from headlab.costs.tiles.offset_nodes import Node, Offset
from headlab.spec.tile_states import EMPTY, FULL, PARTIAL

__all__ = ["CAUSAL", "And", "Combine", "Not", "Or"]

CAUSAL = Offset(((0, None),))  # the causal pattern, ANDed with a tree when the call is causal


@dataclass(frozen=True)
class _Pair(Node):
    a: Node
    b: Node

    def breaks(self, g: Grid):
        return [*self.a.breaks(g), *self.b.breaks(g)]

    def t_breaks(self, g: Grid, hgt: int, wid: int):
        return [*self.a.t_breaks(g, hgt, wid), *self.b.t_breaks(g, hgt, wid)]

    def cuts(self, g: Grid):
        (ra, ca), (rb, cb) = self.a.cuts(g), self.b.cuts(g)
        return [*ra, *rb], [*ca, *cb]


class And(_Pair):
    def sets(self, row: Row, need_full: bool):
        na, fa = self.a.sets(row, need_full)
        nb, fb = self.b.sets(row, need_full)
        return row.run.inter(na, nb), (row.run.inter(fa, fb) if need_full else None)

    def state_at(self, ctx) -> int:
        return min(self.a.state_at(ctx), self.b.state_at(ctx))


class Or(_Pair):
    def sets(self, row: Row, need_full: bool):
        na, fa = self.a.sets(row, need_full)
        nb, fb = self.b.sets(row, need_full)
        return row.run.union(na, nb), (row.run.union(fa, fb) if need_full else None)

    def state_at(self, ctx) -> int:
        return max(self.a.state_at(ctx), self.b.state_at(ctx))


@dataclass(frozen=True)
class Not(Node):
    a: Node

    def sets(self, row: Row, need_full: bool):
        na, fa = self.a.sets(row, True)  # the complement of FULL is what ~ leaves visible
        ne = row.run.complement(fa, row.j0, row.j1)
        return ne, (row.run.complement(na, row.j0, row.j1) if need_full else None)

    def breaks(self, g: Grid):
        return self.a.breaks(g)

    def t_breaks(self, g: Grid, hgt: int, wid: int):
        return self.a.t_breaks(g, hgt, wid)

    def cuts(self, g: Grid):
        return self.a.cuts(g)

    def state_at(self, ctx) -> int:
        return FULL - self.a.state_at(ctx)


@dataclass(frozen=True)
class Combine(Node):
    """The slices of one mask (batch elements, heads) as the tiled kernel walks them: a tile is
    skipped when every slice leaves it empty, and left unmasked when every slice has it full."""

    parts: tuple

    def sets(self, row: Row, need_full: bool):
        ne: list = []
        full = None
        for p in self.parts:
            n, f = p.sets(row, need_full)
            ne = row.run.union(ne, n)
            if need_full:
                full = f if full is None else row.run.inter(full, f)
        return ne, full

    def breaks(self, g: Grid):
        return [b for p in self.parts for b in p.breaks(g)]

    def t_breaks(self, g: Grid, hgt: int, wid: int):
        return [t for p in self.parts for t in p.t_breaks(g, hgt, wid)]

    def cuts(self, g: Grid):
        rows: list = []
        cols: list = []
        for p in self.parts:
            r, c = p.cuts(g)
            rows, cols = rows + r, cols + c
        return rows, cols

    def state_at(self, ctx) -> int:
        states = [p.state_at(ctx) for p in self.parts]
        return EMPTY if max(states) == EMPTY else (FULL if min(states) == FULL else PARTIAL)
