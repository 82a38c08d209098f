"""Counting the tiles of a block map a few block rows at a time, for masks no closed form here reads.

BigBird's random blocks (drawn per block row: only drawing them tells which tiles they hit), your
own mask functions, and compositions the counters of this package cannot read are counted on the
kernel's own block map, computed by the same classifier
(:func:`headlab.spec.blocks.block_rows`) a chunk of block rows at a time: memory stays at a
chunk of about :data:`CHUNK` tile states (a few rows of the map, never all of it), and time grows with
the number of tiles. A count estimated at more than :data:`STREAM_BUDGET` tile states (about half a second)
is refused before it starts with :class:`~headlab.errors.CountTooLargeError`, which gives the
estimate, the longest length counted exactly, and for BigBird the range its visited tiles lie in.
"""

from __future__ import annotations

import math

import torch

from headlab.costs.model import AttentionShape
from headlab.costs.tiles.grid import Grid
from headlab.costs.tiles.interval_count import count_tiles
from headlab.costs.tiles.logic_nodes import CAUSAL, And, Or
from headlab.costs.tiles.offset_nodes import Node, Offset
from headlab.costs.tiles.run_nodes import Global
from headlab.errors import CountTooLargeError
from headlab.spec.blocks import block_rows
from headlab.spec.masks import causal, full
from headlab.spec.tile_states import EMPTY, FULL, PARTIAL

__all__ = ["CHUNK", "STREAM_BUDGET", "pairs", "tiles", "work"]

STREAM_BUDGET = 1 << 22  # tile states evaluated for one prediction, at most (about half a second)
CHUNK = 1 << 18  # tile states per chunk of block rows (a few MiB of temporaries)
_CAUSAL_MASK = causal()
_FULL_MASK = full()


def _leaves(mask):
    parts = getattr(mask, "parts", ())
    if not parts:
        yield mask
        return
    for p in parts[1:]:
        yield from _leaves(p)


def work(shape: AttentionShape, block_q: int, block_k: int) -> int:
    """Tile states (or their equivalent in time) that streaming the block map of ``shape`` evaluates."""
    mask = shape.mask
    n_qb, n_kb = -(-shape.q_len // block_q), -(-shape.kv_len // block_k)
    if mask is None:
        return n_qb * n_kb
    bm = shape.batch if mask.batch_dependent else 1
    hm = shape.heads if mask.head_dependent else 1
    tiles = n_qb * n_kb * bm * hm
    if mask._blocks is None:  # evaluated element by element: about 8 elements per tile state of time
        return tiles + shape.q_len * shape.kv_len * bm * hm // 8
    extra = 0
    for leaf in _leaves(mask):
        bb = getattr(leaf, "bigbird", None)
        if bb is not None:  # one permutation of the key blocks drawn per block row
            extra += -(-shape.q_len // bb["block"]) * -(-shape.kv_len // bb["block"]) // 8
        elif str(leaf.name).startswith("fixed("):  # its classifier works per query row: measured
            extra += tiles * block_q * 3 // 2  # about 1.5 tile states of time per (query, key tile)
        elif getattr(leaf, "layout", None) is not None:
            extra += leaf.layout.numel() // 8
    return tiles + extra


def _chunks(n_qb: int, row_cost: int):
    step = max(1, CHUNK // max(1, row_cost))
    for i0 in range(0, n_qb, step):
        yield i0, min(n_qb, i0 + step)


def _check(shape: AttentionShape, block_q: int, block_k: int, why: Exception) -> None:
    w = work(shape, block_q, block_k)
    if w <= STREAM_BUDGET:
        return
    lq, lk = shape.q_len, shape.kv_len
    n_qb, n_kb = -(-lq // block_q), -(-lk // block_k)
    name = getattr(shape.mask, "name", "the mask")
    max_len = int(max(lq, lk) * math.sqrt(STREAM_BUDGET / w))  # the work grows with the square of the length
    bounds = _bigbird_bounds(shape, block_q, block_k)
    msg = (
        f"the tiles of {name} at {lq}x{lk} have no closed form here ({why}); counting them on the block "
        f"map row by row ({n_qb:,} x {n_kb:,} tiles of {block_q}x{block_k}) would evaluate about {w:,} tile "
        f"states, more than the {STREAM_BUDGET:,} (about half a second) headlab spends on one prediction"
    )
    if bounds is not None:
        msg += (
            f"; its window and global blocks alone visit {bounds[0]:,} to {bounds[1]:,} of the "
            f"{n_qb * n_kb:,} tiles per (batch, head), and its random blocks add at most {bounds[2]:,}"
        )
    msg += (
        f"; for an exact count use a length up to about {max_len:,} tokens, or a pattern counted in closed "
        "form at any length (full, causal, sliding_window, dilated_window, strided, fixed, global_tokens, "
        "documents, padding, block_layout, and & | ~ of them)"
    )
    low_high = (bounds[0], min(n_qb * n_kb, bounds[1] + bounds[2])) if bounds is not None else None
    raise CountTooLargeError(msg, work=w, budget=STREAM_BUDGET, max_len=max_len, bounds=low_high)


def _bigbird_bounds(shape: AttentionShape, block_q: int, block_k: int) -> tuple[int, int, int] | None:
    """``(low, high, random)`` for a BigBird mask: the tiles of its window and global blocks lie
    between those of offsets ``|d| <= h b`` and ``|d| <= (h + 1) b - 1`` with the global rows and
    columns (``h = window_blocks // 2``, ``b`` the block); each random block adds at most the tiles
    one block touches."""
    bb = getattr(shape.mask, "bigbird", None)
    if bb is None or getattr(shape.mask, "parts", None):
        return None
    b, h, g, r = bb["block"], bb["window_blocks"] // 2, bb["global_blocks"], bb["random_blocks"]
    grid = Grid(shape.q_len, shape.kv_len, block_q, block_k)
    out = []
    for reach in (h * b, (h + 1) * b - 1):
        tree: Node = Offset(((-reach, reach),))
        if g:
            tree = Or(tree, Global(((0, g * b - 1),)))
        out.append(count_tiles(grid, And(tree, CAUSAL) if shape.causal else tree)[0])
    nq, nk = -(-shape.q_len // b), -(-shape.kv_len // b)
    rand = nq * min(r, nk) * (-(-b // block_q) + 1) * (-(-b // block_k) + 1)
    return out[0], out[1], min(rand, grid.n_qb * grid.n_kb - out[0])


def tiles(shape: AttentionShape, block_q: int, block_k: int, why: Exception) -> int:
    """Non-empty tiles of the sparse kernel's map (``mask & causal``), summed over batch and heads."""
    _check(shape, block_q, block_k, why)
    # the map the sparse kernel walks: the mask (every tile without one), ANDed with causal for a causal call
    mask = _FULL_MASK if shape.mask is None else shape.mask
    if shape.causal:
        mask = _CAUSAL_MASK if shape.mask is None else shape.mask & _CAUSAL_MASK
    n_qb, n_kb = -(-shape.q_len // block_q), -(-shape.kv_len // block_k)
    bm = shape.batch if mask.batch_dependent else 1
    hm = shape.heads if mask.head_dependent else 1
    total, slices = 0, (1, 1)  # (mask batch, mask heads) of the block rows
    for i0, i1 in _chunks(n_qb, n_kb * bm * hm):
        st = block_rows(mask, shape.q_len, shape.kv_len, block_q, block_k, i0, i1, batch=shape.batch, heads=shape.heads)
        total += int((st != EMPTY).sum())
        slices = (int(st.shape[0]), int(st.shape[1]))
    return total * (shape.batch // slices[0]) * (shape.heads // slices[1])


def pairs(shape: AttentionShape, block_q: int, block_k: int, why: Exception) -> int:
    """Score entries inside the tiles the tiled kernel visits, per (batch, head): its tile states
    combined over batch and heads, ANDed with causal, edge tiles at their size, cut at the diagonal."""
    _check(shape, block_q, block_k, why)
    lq, lk = shape.q_len, shape.kv_len
    n_qb, n_kb = -(-lq // block_q), -(-lk // block_k)
    mask = shape.mask
    bm = shape.batch if mask is not None and mask.batch_dependent else 1
    hm = shape.heads if mask is not None and mask.head_dependent else 1
    ks = torch.arange(n_kb, dtype=torch.int64) * block_k
    widths = torch.clamp(ks + block_k, max=lk) - ks
    total = 0
    for i0, i1 in _chunks(n_qb, n_kb * bm * hm):
        st = torch.full((i1 - i0, n_kb), FULL, dtype=torch.int8)
        if mask is not None:
            m = block_rows(mask, lq, lk, block_q, block_k, i0, i1, batch=shape.batch, heads=shape.heads)
            m = m.reshape(-1, i1 - i0, n_kb)
            lo, hi = m.amin(0), m.amax(0)
            st = torch.where(hi == EMPTY, EMPTY, torch.where(lo == FULL, FULL, PARTIAL)).to(torch.int8)
        qs = torch.arange(i0, i1, dtype=torch.int64) * block_q
        hgt = torch.clamp(qs + block_q, max=lq) - qs
        width = widths[None, :].expand(i1 - i0, n_kb)
        if shape.causal:
            st = torch.minimum(st, block_rows(_CAUSAL_MASK, lq, lk, block_q, block_k, i0, i1)[0, 0])
            width = torch.clamp(torch.minimum(ks[None, :] + widths[None, :], (qs + hgt)[:, None]) - ks[None, :], min=0)
        total += int((hgt[:, None] * width * (st != EMPTY)).sum())
    return total
