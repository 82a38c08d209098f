"""The band of a mask: its visible offsets ``q_idx - kv_idx`` as one interval, read from its structure.

A mask is a *band* ``(lo, hi)`` when it shows exactly the pairs with ``lo <= q_idx - kv_idx <= hi``
(None = unbounded on that side), whatever the batch index, head and lengths. Leaves declare their
band (:class:`~headlab.spec.masks.algebra.MaskFn`'s ``offsets``: ``full``, ``causal``,
``sliding_window``, ``dilated_window`` with dilation 1); :func:`band_of` derives one for a
composition from its nodes. Underneath, the visible offsets of a composition of bands are a set of
disjoint intervals, which ``&`` (intersection), ``|`` (union) and ``~`` (complement) keep exact; the
mask is a band when that set is one interval::

    a & b    the intersection of the two bands
    a | b    one band when the bands overlap or touch (else two: not a band)
    ~a       one band when ``a`` is open on one side (a bounded band leaves two pieces)

Kernels that walk a band of keys around each query (the compiled one-pass kernel) read it, so
``causal() & sliding_window(w)`` takes their fast path like ``sliding_window(w, causal=True)``.

    >>> from headlab import masks
    >>> masks.band_of(masks.causal() & masks.sliding_window(4))
    (0, 4)
    >>> masks.band_of(masks.sliding_window(2, causal=True) | masks.sliding_window(1))
    (-1, 2)
    >>> masks.band_of(~masks.causal())                   # keys after the query: i - j <= -1
    (None, -1)
    >>> masks.band_of(masks.sliding_window(1) | ~masks.sliding_window(5)) is None   # two bands
    True
    >>> masks.band_of(masks.sliding_window(1) | ~masks.sliding_window(1))         # every offset
    (None, None)
"""

from __future__ import annotations

import math

from headlab.spec.masks.algebra import MaskFn

__all__ = ["Band", "band_of"]

Band = tuple[int | None, int | None]  # (lo, hi): lo <= q_idx - kv_idx <= hi, None = unbounded
# visible offsets as sorted, disjoint, non-touching closed intervals (lo, hi); -inf / +inf for unbounded
_Set = tuple[tuple[float, float], ...]
_ALL: _Set = ((-math.inf, math.inf),)
_NONE: _Set = ()


def band_of(mask) -> Band | None:
    """``(lo, hi)`` when ``mask`` shows exactly the offsets ``lo <= q_idx - kv_idx <= hi`` (None:
    unbounded on that side), else None: not a mask function, not one band (two bands, a dilation,
    a dependence on the batch, head or lengths), or nothing visible at all."""
    got = _offsets(mask) if isinstance(mask, MaskFn) else None
    if got is None or len(got) != 1:
        return None
    lo, hi = got[0]
    return (None if math.isinf(lo) else int(lo), None if math.isinf(hi) else int(hi))


def _offsets(mask: MaskFn) -> _Set | None:
    """The visible offsets of ``mask`` as intervals, or None when they are not known from its structure
    (a leaf that declares no band)."""
    parts = mask.parts
    if not parts:
        if mask.offsets is None:
            return None
        lo, hi = mask.offsets
        return _normal([(-math.inf if lo is None else lo, math.inf if hi is None else hi)])
    if parts[0] == "~":
        a = _offsets(parts[1])
        return None if a is None else _complement(a)
    a, b = _offsets(parts[1]), _offsets(parts[2])
    if parts[0] == "&":
        if a is None or b is None:  # nothing & anything = nothing; everything & X = X
            other = b if a is None else a
            return _NONE if other == _NONE else (a if b == _ALL else b if a == _ALL else None)
        return _normal([(max(x[0], y[0]), min(x[1], y[1])) for x in a for y in b])
    if a is None or b is None:  # everything | anything = everything; nothing | X = X
        other = b if a is None else a
        return _ALL if other == _ALL else (a if b == _NONE else b if a == _NONE else None)
    return _normal([*a, *b])


def _normal(intervals) -> _Set:
    """Sorted, empty ones dropped, overlapping or touching ones (``hi + 1 >= lo``) merged."""
    out: list[list[float]] = []
    for lo, hi in sorted(i for i in intervals if i[0] <= i[1]):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _complement(a: _Set) -> _Set:
    """The offsets ``a`` leaves out: the gaps before, between and after its intervals."""
    gaps, start = [], -math.inf
    for lo, hi in a:
        if lo > start:  # no gap before an interval open to the left
            gaps.append((start, lo - 1))
        start = hi + 1
    if start < math.inf:  # no gap after an interval open to the right
        gaps.append((start, math.inf))
    return tuple(gaps)
