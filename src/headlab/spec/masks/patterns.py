"""Sparse patterns that depend on the offset ``q_idx - kv_idx``: windows (Longformer), the
Sparse Transformer's strided and fixed patterns.

Each is a MaskFn with an EXACT closed-form block classifier:
``block_map(m, ...)`` agrees tile for tile with reducing ``m.dense(...)`` (tested). Composing
patterns with & | ~ keeps a classifier that is conservative (never calls a visible tile
EMPTY nor a partly hidden tile FULL), so kernels stay exact.

Sizes larger than the sequence are not errors: a window wider than the sequence sees the
whole sequence, a pattern block larger than the sequence is one block, more global or
random blocks than there are blocks means all of them. Zero or negative sizes raise
ConfigError when the pattern is built; a block layout whose shape does not match the
sequence raises MaskError when it is evaluated (that is when the length is known).
A query row that sees no key is allowed: backends return zeros for it.
"""

from __future__ import annotations

import torch

import headlab.checks as checks
from headlab.errors import ConfigError
from headlab.spec.masks.algebra import MaskFn, block_bounds, prefix_length
from headlab.spec.tile_states import EMPTY, FULL, PARTIAL

__all__ = ["dilated_window", "fixed", "sliding_window", "strided"]


def _offset_blocks(visible_offset):
    """Exact block classifier of a mask that depends only on ``delta = q_idx - kv_idx``.

    Inside a tile with rows ``[qs, qe]`` and columns ``[ks, ke]`` the offsets take every
    integer value in ``[qs - ke, qe - ks]``; the tile is FULL when all of them are visible and
    EMPTY when none is. Prefix sums over the visible offsets answer both per tile in O(1).
    ``visible_offset(delta, q_len, kv_len) -> bool`` is the mask as a function of the offset.
    """

    def blocks(lq, lk, bq, bk, device, rows=None):
        qs, qe = block_bounds(lq, bq, device, rows)
        ks, ke = block_bounds(lk, bk, device)
        d0 = int(qs[0]) - (lk - 1) if len(qs) else 0  # the smallest offset these rows can have
        deltas = torch.arange(d0, int(qe[-1]) + 1 if len(qe) else 0, device=device)  # every offset they see
        vis = visible_offset(deltas, lq, lk).to(torch.long)
        cs = torch.nn.functional.pad(torch.cumsum(vis, 0), (1, 0))  # cs[i] = visible offsets below index i
        lo = (qs[:, None] - ke[None, :]) - d0  # index of the smallest offset in the tile
        hi = (qe[:, None] - ks[None, :]) - d0
        count = cs[hi + 1] - cs[lo]
        state = torch.where(count == hi - lo + 1, FULL, torch.where(count > 0, PARTIAL, EMPTY)).to(torch.int8)
        return state.view(1, 1, *state.shape)

    return blocks


def _offset_mask(visible_offset, name: str, band: tuple[int | None, int | None] | None = None) -> MaskFn:
    """A mask of the offset alone; ``band``: ``(lo, hi)`` when the visible offsets are exactly ``lo..hi``."""

    def fn(b, h, q, kv, lq, lk):
        return visible_offset(q - kv, lq, lk)

    return MaskFn(fn, name, blocks=_offset_blocks(visible_offset), offsets=band)


def sliding_window(window: int, causal: bool = False) -> MaskFn:
    """Local attention: query ``i`` sees keys ``j`` with ``|i - j| <= window`` (Longformer).

    With ``causal=True`` only the past half: ``0 <= i - j <= window`` (each query sees itself and
    the ``window`` keys before it; Mistral-style). Positions are top-left aligned like
    :func:`causal`. A window wider than the sequence sees everything.

    Args:
        window: largest distance ``|i - j|`` that is visible, ``>= 1``.
        causal: keep only keys at or before the query.

    ``sliding_window(1)`` and ``sliding_window(2, causal=True)`` on 5 positions::

        >>> from headlab import masks
        >>> masks.sliding_window(1).dense(q_len=5)[0, 0].int()
        tensor([[1, 1, 0, 0, 0],
                [1, 1, 1, 0, 0],
                [0, 1, 1, 1, 0],
                [0, 0, 1, 1, 1],
                [0, 0, 0, 1, 1]], dtype=torch.int32)
        >>> masks.sliding_window(2, causal=True).dense(q_len=5)[0, 0].int()
        tensor([[1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [1, 1, 1, 0, 0],
                [0, 1, 1, 1, 0],
                [0, 0, 1, 1, 1]], dtype=torch.int32)
    """
    w = checks.positive_int("sliding_window window", window)
    if causal:
        return _offset_mask(lambda d, lq, lk: (d >= 0) & (d <= w), f"sliding_window({w}, causal)", (0, w))
    return _offset_mask(lambda d, lq, lk: d.abs() <= w, f"sliding_window({w})", (-w, w))


def dilated_window(window: int, dilation: int, causal: bool = False) -> MaskFn:
    """Dilated sliding window (Longformer): ``window`` keys on each side, ``dilation`` apart.

    Query ``i`` sees keys ``j = i + t * dilation`` for ``|t| <= window`` (``0 <= t`` with ``causal``):
    the receptive field reaches ``window * dilation`` positions on each side while each query
    still sees ``2 * window + 1`` keys. ``dilated_window(w, 1) == sliding_window(w)``.

        >>> from headlab import masks
        >>> masks.dilated_window(1, 2).dense(q_len=6)[0, 0].int()
        tensor([[1, 0, 1, 0, 0, 0],
                [0, 1, 0, 1, 0, 0],
                [1, 0, 1, 0, 1, 0],
                [0, 1, 0, 1, 0, 1],
                [0, 0, 1, 0, 1, 0],
                [0, 0, 0, 1, 0, 1]], dtype=torch.int32)
    """
    w = checks.positive_int("dilated_window window", window)
    s = checks.positive_int("dilated_window dilation", dilation)
    reach = w * s
    band = ((0 if causal else -reach), reach) if s == 1 else None  # dilation 1: every offset of the reach
    if causal:
        return _offset_mask(
            lambda d, lq, lk: (d >= 0) & (d <= reach) & (d % s == 0), f"dilated_window({w}, {s}, causal)", band
        )
    return _offset_mask(lambda d, lq, lk: (d.abs() <= reach) & (d % s == 0), f"dilated_window({w}, {s})", band)


def strided(stride: int, causal: bool = True) -> MaskFn:
    """The Sparse Transformer's *strided* pattern (Child et al. 2019), both heads merged.

    Query ``i`` sees the previous ``stride`` keys (``0 <= i - j <= stride``, the local head) and
    every key a multiple of ``stride`` back (``(i - j) % stride == 0``, the strided head). As in
    the paper the pattern is causal (``j <= i``); ``causal=False`` mirrors it to both sides.
    About ``2 * sqrt(n)`` keys per query when ``stride ~ sqrt(n)``.

        >>> from headlab import masks
        >>> masks.strided(2).dense(q_len=6)[0, 0].int()
        tensor([[1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0],
                [0, 1, 1, 1, 0, 0],
                [1, 0, 1, 1, 1, 0],
                [0, 1, 0, 1, 1, 1]], dtype=torch.int32)
    """
    s = checks.positive_int("strided stride", stride)
    if causal:
        return _offset_mask(lambda d, lq, lk: (d >= 0) & ((d <= s) | (d % s == 0)), f"strided({s})")
    return _offset_mask(lambda d, lq, lk: (d.abs() <= s) | (d % s == 0), f"strided({s}, non-causal)")


def fixed(stride: int, summary: int = 1, causal: bool = True) -> MaskFn:
    """The Sparse Transformer's *fixed* pattern (Child et al. 2019), both heads merged.

    Positions fall in blocks of ``stride``. Query ``i`` sees every key of its own block and
    the last ``summary`` keys ("summary" cells) of every block: ``j // stride == i // stride``
    or ``j % stride >= stride - summary``. As in the paper the pattern is causal (``j <= i``);
    ``causal=False`` keeps both directions (summary cells of later blocks too).

    Args:
        stride: block length ``l``, ``>= 1``.
        summary: summary cells per block ``c``, ``1 <= c <= stride``.

        >>> from headlab import masks
        >>> masks.fixed(3, 1).dense(q_len=7)[0, 0].int()
        tensor([[1, 0, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0, 0],
                [0, 0, 1, 1, 0, 0, 0],
                [0, 0, 1, 1, 1, 0, 0],
                [0, 0, 1, 1, 1, 1, 0],
                [0, 0, 1, 0, 0, 1, 1]], dtype=torch.int32)
    """
    s = checks.positive_int("fixed stride", stride)
    c = checks.positive_int("fixed summary", summary)
    if c > s:
        raise ConfigError(f"fixed summary={c} must be <= stride={s} (it counts cells inside each block)")

    def fn(b, h, q, kv, lq, lk):
        m = ((q // s) == (kv // s)) | ((kv % s) >= s - c)
        return (m & (kv <= q)) if causal else m

    def blocks(lq, lk, bq, bk, device, rows=None):
        # Exact: per query row, count visible keys of every key tile with interval arithmetic,
        # then a tile is FULL when each of its rows sees all its keys, EMPTY when none sees any.
        i0, i1 = rows if rows is not None else (0, -(-lq // bq))
        qi = torch.arange(i0 * bq, min(lq, i1 * bq), device=device)
        ks, ke = block_bounds(lk, bk, device)
        summ = prefix_length(torch.arange(lk, device=device) % s >= s - c)  # (lk + 1,)
        hi_cap = qi[:, None] if causal else torch.full_like(qi[:, None], lk - 1)
        lo, hi = ks[None, :], torch.minimum(ke[None, :], hi_cap)  # keys of the tile the row may see

        def count_in(a, z):  # summary cells in [a, z] (empty when z < a)
            z = torch.clamp(z, min=-1, max=lk - 1)
            a = torch.clamp(a, min=0)
            return torch.where(z >= a, summ[z + 1] - summ[torch.minimum(a, z + 1)], 0)

        bs = (qi // s * s)[:, None]
        be = torch.minimum(bs + s - 1, hi_cap)
        b_lo, b_hi = torch.maximum(lo, bs), torch.minimum(hi, be)
        n_block = torch.clamp(b_hi - b_lo + 1, min=0)
        n_summ = count_in(lo, hi)
        n_both = torch.where(b_hi >= b_lo, count_in(b_lo, b_hi), 0)
        seen = n_block + n_summ - n_both  # (lq, n_kb) keys of each tile each row sees
        size = (ke - ks + 1)[None, :]
        nqb = i1 - i0
        pad = nqb * bq - len(qi)
        row_full = torch.nn.functional.pad((seen == size).to(torch.int8), (0, 0, 0, pad), value=1)
        row_any = torch.nn.functional.pad((seen > 0).to(torch.int8), (0, 0, 0, pad), value=0)
        full = row_full.view(nqb, bq, -1).amin(1) > 0
        any_ = row_any.view(nqb, bq, -1).amax(1) > 0
        state = torch.where(full, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8)
        return state.view(1, 1, *state.shape)

    return MaskFn(fn, f"fixed({s}, {c}{'' if causal else ', non-causal'})", blocks=blocks)
