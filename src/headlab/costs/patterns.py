"""The built-in mask patterns as the tile counter sees them: which key tiles a block row visits.

:func:`structure` turns a mask into a tree of the nodes below, read from the mask's public
``name`` (``"(sliding_window(256, causal) | global_tokens([0]))"``: the constructor and its
arguments, composed with ``&``, ``|``, ``~``). A mask it cannot read (a user function, padding,
a block layout, BigBird's random blocks, a list shown shortened) raises
:class:`~headlab.costs.tilecount.Unsupported`, and the caller counts the block map instead.

Each node answers, for one tile class of one run of block rows (:class:`~headlab.costs.tilecount.Row`),
the key tiles that are non-empty and those that are full, as interval lists, exactly as the
pattern's block classifier states them; ``&`` / ``|`` / ``~`` combine those states as block maps
do (min, max, FULL <-> EMPTY), so the counts equal the block map's tile for tile.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache

from headlab.costs.tilecount import Grid, Lin, Row, Unsupported

__all__ = ["structure"]


# -- combinations ---------------------------------------------------------------------------

@dataclass(frozen=True)
class And:
    a: object
    b: object

    def sets(self, row: Row, need_full: bool):
        na, fa = self.a.sets(row, need_full)
        nb, fb = self.b.sets(row, need_full)
        return row.run.inter(na, nb), (row.run.inter(fa, fb) if need_full else None)

    def breaks(self, g: Grid):
        return [*self.a.breaks(g), *self.b.breaks(g)]


@dataclass(frozen=True)
class Or:
    a: object
    b: object

    def sets(self, row: Row, need_full: bool):
        na, fa = self.a.sets(row, need_full)
        nb, fb = self.b.sets(row, need_full)
        return row.run.union(na, nb), (row.run.union(fa, fb) if need_full else None)

    def breaks(self, g: Grid):
        return [*self.a.breaks(g), *self.b.breaks(g)]


@dataclass(frozen=True)
class Not:
    a: object

    def sets(self, row: Row, need_full: bool):
        na, fa = self.a.sets(row, True)  # the complement of FULL is what ~ leaves visible
        ne = row.run.complement(fa, row.j0, row.j1)
        return ne, (row.run.complement(na, row.j0, row.j1) if need_full else None)

    def breaks(self, g: Grid):
        return self.a.breaks(g)


# -- patterns of the offset d = q_idx - kv_idx -------------------------------------------------

_INF = None


def _band_sets(row: Row, lo: int | None, hi: int | None):
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


@dataclass(frozen=True)
class Offset:
    """A pattern visible on offset intervals: ``bands`` of ``(lo, hi)`` (None: unbounded)."""

    bands: tuple  # ((lo, hi), ...): disjoint and not adjacent (so FULL tiles lie inside one)
    dilation: int = 1  # visible offsets inside a band are the multiples of this
    strided: int = 0  # > 0: every multiple of this beyond the bands is visible too (strided pattern)
    kv_minus_q: bool = False  # causal_lower_right: the band is shifted by kv_len - q_len

    def sets(self, row: Row, need_full: bool):
        span = row.hgt + row.wid - 1  # offsets seen by one tile
        shift = row.grid.kv_len - row.grid.q_len if self.kv_minus_q else 0
        bands = [(None if lo is None else lo - shift, None if hi is None else hi - shift) for lo, hi in self.bands]
        if self.dilation > 1:
            if span < self.dilation:  # a tile can fall between two visible offsets: periodic, not a band
                raise Unsupported(f"dilation {self.dilation} is wider than a tile's offsets ({span})")
            # every interval of >= dilation offsets holds a multiple; the band's ends are multiples
            if span > 1:
                ne = [_band_sets(row, lo, hi)[0] for lo, hi in bands]
                return _union_all(row, ne), ([] if need_full else None)
        if self.strided:
            s = self.strided
            if span < s:
                raise Unsupported(f"stride {s} is wider than a tile's offsets ({span})")
            # every tile that reaches past the local band holds a multiple of the stride
            causal = bands[0][0] == 0  # strided(s): d >= 0; strided(s, non-causal): every d
            ne, full = _band_sets(row, 0 if causal else None, None)
            if s == 1:  # every offset (every offset >= 0) is a multiple of 1
                return ne, full
            if span == 1 and need_full:
                raise Unsupported("full tiles of a strided pattern on 1x1 tiles")
            # a tile holding two consecutive offsets beyond the local band holds a hidden one
            return ne, _band_sets(row, *bands[0])[1]
        parts = [_band_sets(row, lo, hi) for lo, hi in bands]
        return _union_all(row, [p[0] for p in parts]), _union_all(row, [p[1] for p in parts])

    def breaks(self, g: Grid):
        return []


def _union_all(row: Row, sets):
    out: list = []
    for s in sets:
        out = row.run.union(out, s)
    return out


# -- the Sparse Transformer's fixed pattern ------------------------------------------------------

@dataclass(frozen=True)
class Fixed:
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
            return (_band_sets(row, 0, None)[0] if self.causal else row.all()), None
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


# -- patterns constant over runs of rows ------------------------------------------------------

def _runs(sorted_pos: list[int], n: int):
    """Maximal runs ``[a, b]`` of consecutive positions (< n) in a sorted list."""
    out: list[list[int]] = []
    for p in sorted_pos:
        if p >= n:
            break
        if out and p == out[-1][1] + 1:
            out[-1][1] = p
        else:
            out.append([p, p])
    return out


@lru_cache(maxsize=64)
def _global_cols(indices: tuple, kv_len: int, bk: int, wid: int, ja: int, jb: int):
    """Key tiles in ``[ja, jb]`` (each ``wid`` wide) holding a global key / only global keys, as
    constant intervals (the same for every block row: computed once per tile class)."""
    ne: list[list[int]] = []
    full: list[list[int]] = []
    for a, b in _runs(list(indices), kv_len):
        for out, lo, hi in ((ne, max(ja, a // bk), min(jb, b // bk)),
                            (full, max(ja, -(-a // bk)), min(jb, (b - wid + 1) // bk))):
            if lo > hi:
                continue
            if out and lo <= out[-1][1] + 1:
                out[-1][1] = max(out[-1][1], hi)
            else:
                out.append([lo, hi])
    return [(Lin(0, a), Lin(0, b)) for a, b in ne], [(Lin(0, a), Lin(0, b)) for a, b in full]


@dataclass(frozen=True)
class Global:
    """``global_tokens(indices)``: global rows see every key, every row sees global columns."""

    indices: tuple  # sorted, unique, >= 0

    def _cols(self, row: Row):
        g = row.grid
        return _global_cols(self.indices, g.kv_len, g.block_k, row.wid, row.j0.b, row.j1.b)

    def sets(self, row: Row, need_full: bool):
        g = row.grid
        qs = row.row * g.block_q
        qe = qs + row.hgt - 1
        idx = self.indices
        n_global_rows = bisect_right(idx, qe) - bisect_right(idx, qs - 1)
        ne_c, full_c = self._cols(row)
        if n_global_rows == row.hgt:
            return row.all(), row.all()
        if n_global_rows:
            return row.all(), full_c
        return ne_c, full_c

    def breaks(self, g: Grid):
        out = []
        for i in self.indices:
            if i < g.q_len:
                out += [i // g.block_q, i // g.block_q + 1]
        return out


@dataclass(frozen=True)
class Documents:
    """``documents(lengths)``: a query sees the keys of its own document."""

    ends: tuple  # exclusive end of each document, increasing

    def sets(self, row: Row, need_full: bool):
        g = row.grid
        total = self.ends[-1]
        if g.q_len != total or g.kv_len != total:
            raise Unsupported("documents whose lengths do not add up to the sequence (the mask refuses it)")
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


# -- reading a mask ---------------------------------------------------------------------------

def _split_top(text: str, seps: tuple[str, ...]):
    """Split ``text`` at a separator outside any brackets: ``(left, sep, right)`` or None."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif depth == 0:
            for sep in seps:
                if text.startswith(sep, i):
                    return text[:i], sep, text[i + len(sep):]
    return None


def _ints(text: str) -> list[int]:
    if "..." in text:
        raise Unsupported("a shortened index list")
    return [int(x) for x in re.findall(r"-?\d+", text)]


_LEAF = re.compile(r"^(\w+)(?:\((.*)\))?$")


def _leaf(name: str, args: str):
    a = [x.strip() for x in args.split(",")] if args and "[" not in args else []
    flags = {x for x in a if not re.fullmatch(r"-?\d+", x)}
    nums = [int(x) for x in a if re.fullmatch(r"-?\d+", x)]
    causal = "causal" in flags
    if name == "full" and not args:
        return Offset(((None, None),))
    if name == "causal" and not args:
        return Offset(((0, None),))
    if name == "causal_lower_right" and not args:
        return Offset(((0, None),), kv_minus_q=True)
    if name == "sliding_window" and len(nums) == 1:
        w = nums[0]
        return Offset(((0, w),) if causal else ((-w, w),))
    if name == "dilated_window" and len(nums) == 2:
        w, s = nums
        reach = w * s
        return Offset(((0, reach),) if causal else ((-reach, reach),), dilation=s)
    if name == "strided" and len(nums) == 1:
        s = nums[0]
        return Offset(((-s, s),) if "non-causal" in flags else ((0, s),), strided=s)
    if name == "fixed" and len(nums) == 2:
        return Fixed(nums[0], nums[1], causal="non-causal" not in flags)
    if name == "global_tokens" and args:
        return Global(tuple(sorted(set(_ints(args)))))
    if name == "documents" and args:
        lens = _ints(args)
        ends, total = [], 0
        for n in lens:
            total += n
            ends.append(total)
        return Documents(tuple(ends))
    raise Unsupported(f"no closed form for pattern {name!r}")


def _parse(text: str):
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        inner = text[1:-1]
        split = _split_top(inner, (" | ",)) or _split_top(inner, (" & ",))
        if split is not None:
            left, sep, right = split
            node = And if sep.strip() == "&" else Or
            return node(_parse(left), _parse(right))
        return _parse(inner)
    if text.startswith("~"):
        return Not(_parse(text[1:]))
    m = _LEAF.match(text)
    if m is None:
        raise Unsupported(f"cannot read mask {text!r}")
    return _leaf(m.group(1), m.group(2) or "")


def _listed(mask, attr: str) -> list[int] | None:
    """A pattern's full index list from a public attribute, where the pattern object has one
    (its name shows at most 8 entries)."""
    val = getattr(mask, attr, None)
    if val is None:
        return None
    try:
        return [int(x) for x in (val.flatten().tolist() if hasattr(val, "flatten") else val)]
    except (TypeError, ValueError):
        return None


def structure(mask):
    """The tile-count tree of ``mask`` (None: no mask, every tile), or raise ``Unsupported``."""
    if mask is None:
        return Offset(((None, None),))
    if getattr(mask, "batch_dependent", False) or getattr(mask, "head_dependent", False):
        raise Unsupported("a mask that changes with the batch or head index")
    name = str(mask.name)
    if "..." in name and name.startswith("global_tokens(") and _listed(mask, "indices"):
        return Global(tuple(sorted(set(_listed(mask, "indices")))))
    if "..." in name and name.startswith("documents(") and _listed(mask, "lengths"):
        return _leaf("documents", ",".join(map(str, _listed(mask, "lengths"))))
    return _parse(name)
