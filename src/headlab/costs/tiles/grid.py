"""The vocabulary of the tile counters: a call's tile :class:`Grid`, one run of block rows (:class:`Row`,
evaluated by a :class:`Run` that remembers how long its comparisons hold), interval ends affine in the row
(:class:`Lin`), counts polynomial in it (:class:`Poly`), and :class:`Unsupported`, raised by a counter that
cannot read a pattern (the caller tries the next one)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cmp_to_key
from math import gcd

__all__ = ["Grid", "Lin", "Poly", "Row", "Run", "Unsupported", "rectangles"]


class Unsupported(Exception):
    """This pattern (or this tile class of it) has no closed form here; use the block map."""


@dataclass(frozen=True)
class Lin:
    """``a * m + b`` over integers: an interval endpoint within one residue class of rows."""

    a: int
    b: int

    def at(self, m: int) -> int:
        return self.a * m + self.b

    def __add__(self, k: int) -> Lin:
        return Lin(self.a, self.b + k)

    def __sub__(self, k: int) -> Lin:
        return Lin(self.a, self.b - k)


class Poly:
    """A polynomial in ``m`` with integer coefficients (degree <= 2 is all the counts need; the one
    half in a cut tile's area is kept out by counting twice the area)."""

    def __init__(self, coeffs=(0,)):
        self.c = list(coeffs)

    @staticmethod
    def of(x: Lin | int) -> Poly:
        return Poly((x.b, x.a)) if isinstance(x, Lin) else Poly((x,))

    def __add__(self, o: Poly) -> Poly:
        n = max(len(self.c), len(o.c))
        return Poly([(self.c[i] if i < len(self.c) else 0) + (o.c[i] if i < len(o.c) else 0) for i in range(n)])

    def __mul__(self, o: Poly | int) -> Poly:
        if not isinstance(o, Poly):
            return Poly([x * o for x in self.c])
        out = [0] * (len(self.c) + len(o.c) - 1)
        for i, x in enumerate(self.c):
            for j, y in enumerate(o.c):
                out[i + j] += x * y
        return Poly(out)

    def __neg__(self) -> Poly:
        return self * -1

    def __sub__(self, o: Poly) -> Poly:
        return self + (-o)

    def sum_over(self, m0: int, m1: int) -> int:
        """``sum_{m = m0}^{m1 - 1} p(m)``."""

        def s(n: int, k: int) -> int:  # sum_{m=0}^{n-1} m^k
            if k == 0:
                return n
            if k == 1:
                return n * (n - 1) // 2
            if k == 2:
                return (n - 1) * n * (2 * n - 1) // 6
            if k == 3:
                return (n * (n - 1)) ** 2 // 4
            raise AssertionError(f"degree {k} is not needed by any count")

        return sum(c * (s(m1, k) - s(m0, k)) for k, c in enumerate(self.c) if c)


class Run:
    """Evaluation at row ``m0`` that remembers how far its comparisons keep their outcome."""

    def __init__(self, m0: int, limit: int):
        self.m0 = m0
        self.limit = limit  # exclusive: every comparison made holds for m in [m0, limit)
        self.work = 0  # intervals handled: what one evaluation costs

    def le(self, x: Lin, y: Lin) -> bool:
        """``x <= y`` at ``m0``, shrinking ``limit`` to the first row where the answer changes."""
        a, b = y.a - x.a, y.b - x.b  # y - x = a m + b
        res = a * self.m0 + b >= 0
        if res and a < 0:  # becomes negative at the first m with a m + b < 0
            flip = b // (-a) + 1
        elif not res and a > 0:  # becomes >= 0 at ceil(-b / a)
            flip = -(b // a)
        else:
            return res
        self.limit = min(self.limit, max(flip, self.m0 + 1))
        return res

    def max(self, x: Lin, y: Lin) -> Lin:
        return y if self.le(x, y) else x

    def min(self, x: Lin, y: Lin) -> Lin:
        return x if self.le(x, y) else y

    # -- sets of key tiles: sorted lists of disjoint, non-empty closed intervals (lo, hi) --------
    def norm(self, ivs) -> list[tuple[Lin, Lin]]:
        self.work += len(ivs)
        ivs = [iv for iv in ivs if self.le(iv[0], iv[1])]
        if len({lo.a for lo, _ in ivs}) <= 1:  # starts of one slope keep their order on every row
            ivs.sort(key=lambda iv: iv[0].b)
        elif not all(self.le(p[0], q[0]) for p, q in zip(ivs, ivs[1:])):

            def starts(p: tuple[Lin, Lin], q: tuple[Lin, Lin]) -> int:
                return 0 if p[0] == q[0] else (-1 if self.le(p[0], q[0]) else 1)

            ivs.sort(key=cmp_to_key(starts))
        out: list[tuple[Lin, Lin]] = []
        for lo, hi in ivs:
            if out and self.le(lo, out[-1][1]):  # overlaps the previous one: merge
                out[-1] = (out[-1][0], self.max(out[-1][1], hi))
            else:
                out.append((lo, hi))
        return out

    def inter(self, xs, ys):
        return self.norm([(self.max(a, c), self.min(b, d)) for a, b in xs for c, d in ys])

    def union(self, xs, ys):
        return self.norm([*xs, *ys])

    def complement(self, xs, j0: Lin, j1: Lin):
        out, start = [], j0
        for lo, hi in xs:
            out.append((start, lo - 1))
            start = hi + 1
        out.append((start, j1))
        return self.norm(out)

    @staticmethod
    def count(xs) -> Poly:
        a = sum(hi.a - lo.a for lo, hi in xs)
        b = sum(hi.b - lo.b + 1 for lo, hi in xs)
        return Poly((b, a))


@dataclass(frozen=True)
class Grid:
    """The tile grid of one call: lengths and tile sizes."""

    q_len: int
    kv_len: int
    block_q: int
    block_k: int

    @property
    def n_qb(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def n_kb(self) -> int:
        return -(-self.kv_len // self.block_k)


@dataclass
class Row:
    """One tile class of one residue class of block rows, as the patterns see it."""

    grid: Grid
    run: Run
    P: int  # rows per residue period
    r: int  # residue: I = P m + r
    hgt: int  # query rows per tile in this class
    wid: int  # key columns per tile in this class
    j0: Lin  # first key tile of the class
    j1: Lin  # last key tile of the class

    @property
    def row(self) -> int:
        """The actual block row being evaluated (the run's first)."""
        return self.P * self.run.m0 + self.r

    def band(self, c: int) -> Lin:
        """``floor((I * block_q + c) / block_k)`` as an affine function of ``m``."""
        g = self.grid
        return Lin(g.block_q // gcd(g.block_q, g.block_k), (self.r * g.block_q + c) // g.block_k)

    def qs(self) -> Lin:
        """First query position of the tile row."""
        return Lin(self.P * self.grid.block_q, self.r * self.grid.block_q)

    def const(self, k: int) -> Lin:
        return Lin(0, k)

    def all(self):
        return [(self.j0, self.j1)]


def rectangles(rows, cols):
    """``(ia, ib, height, ja, jb, width)`` for every non-empty pair of a row class ``(ia, ib, height)``
    (block rows ia..ib, each ``height`` queries) and a column class ``(ja, jb, width)``."""
    for ia, ib, hgt in rows:
        if ib < ia:
            continue
        for ja, jb, wid in cols:
            if jb >= ja:
                yield ia, ib, hgt, ja, jb, wid
