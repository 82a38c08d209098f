"""How many tiles (and score entries) the tiled and sparse kernels visit for a shape, predicted
without building the block map they walk.

Each (batch, head) slice of the mask is read as a tree (:mod:`headlab.costs.tiles.mask_tree`) and counted
exactly by the first counter that reads it:

1. :mod:`headlab.costs.tiles.layout_count` and :mod:`headlab.costs.tiles.document_count`: a block layout, or packed
   documents, alone or with causal (documents also with a sliding window), vectorised over cells or
   documents;
2. :mod:`headlab.costs.tiles.interval_count`: the key tiles of a block row are a few intervals moving
   linearly with the row (causal, windows, narrow strides and dilations, global tokens, documents,
   padding, block layouts, ``fixed`` with tiles at least a block wide) - milliseconds at any length;
3. :mod:`headlab.costs.tiles.diagonal_count`: offset patterns of any stride or dilation, also with global
   tokens, documents, padding and small layouts, summed along diagonals with floor sums;
4. :mod:`headlab.costs.tiles.fixed_count`: ``fixed`` with any stride (alone or with causal).

A mask none of them reads (BigBird's random blocks, a user function, some compositions) is counted
on the block map row by row (:mod:`headlab.costs.tiles.streamed_count`) while that takes about a second at most,
and refused beyond with the estimate (:class:`~headlab.errors.CountTooLargeError`).

    >>> from headlab import costs
    >>> shape = costs.AttentionShape(heads=1, q_len=10**12, causal=True)
    >>> tiles(shape, 128, 128) == (7812500000 * 7812500001) // 2
    True
"""

from __future__ import annotations

from headlab.costs.model import AttentionShape
from headlab.costs.tiles import streamed_count
from headlab.costs.tiles.diagonal_count import count_diagonal
from headlab.costs.tiles.document_count import count_documents
from headlab.costs.tiles.fixed_count import count_fixed
from headlab.costs.tiles.grid import Grid, Unsupported
from headlab.costs.tiles.interval_count import count_tiles
from headlab.costs.tiles.layout_count import count_layout
from headlab.costs.tiles.mask_tree import CAUSAL, And, Combine, slices, structure

__all__ = ["MAP_BUDGET", "pairs", "plan_tiles", "tiles"]

# A kernel's block map above this many tiles is worth a note in the cost (its int8 states and the
# classifier's temporaries take about 30 bytes a tile: 60 MiB here).
MAP_BUDGET = 1 << 21

_COUNTERS = (count_layout, count_documents, count_tiles, count_diagonal, count_fixed)  # the fast special cases first


def plan_tiles(shape: AttentionShape, block_q: int, block_k: int) -> int:
    """Tiles of the block map a kernel builds for one slice: ``ceil(Lq / bq) * ceil(Lk / bk)``."""
    return -(-shape.q_len // block_q) * -(-shape.kv_len // block_k)


def _tree(shape: AttentionShape):
    """The tree of a mask with one slice, ANDed with causal when the call is causal."""
    tree = structure(shape.mask)
    return And(tree, CAUSAL) if shape.causal else tree


def exact(grid: Grid, tree, causal_cut: bool = False) -> tuple[int, int]:
    """``(tiles, entries)`` of one tree by the first counter that reads it, or ``Unsupported``
    with the reason of :func:`~headlab.costs.tiles.interval_count.count_tiles`, the general one."""
    why: Unsupported | None = None
    for counter in _COUNTERS:
        try:
            return counter(grid, tree, causal_cut=causal_cut)
        except Unsupported as e:
            why = e if counter is count_tiles else why
    assert why is not None  # count_tiles, the general counter, is among them
    raise why


def tiles(shape: AttentionShape, block_q: int, block_k: int) -> int:
    """Non-empty tiles of the block map of ``shape.mask`` (ANDed with causal when set), summed over
    every (batch, query head): the tiles the sparse kernel computes."""
    grid = Grid(shape.q_len, shape.kv_len, block_q, block_k)
    try:
        total = 0
        for n, tree in slices(shape.mask, shape.batch, shape.heads):
            total += n * exact(grid, And(tree, CAUSAL) if shape.causal else tree)[0]
        return total
    except Unsupported as e:
        return streamed_count.tiles(shape, block_q, block_k, e)


def pairs(shape: AttentionShape, block_q: int, block_k: int) -> int:
    """Score entries inside the tiles the tiled kernel visits, per (batch, head): its tile states
    combined over batch and heads, edge tiles at their real size; under ``causal`` a tile's key
    range stops at its query block's end, as the kernel cuts it."""
    grid = Grid(shape.q_len, shape.kv_len, block_q, block_k)
    try:
        trees = [tree for _, tree in slices(shape.mask, shape.batch, shape.heads)]
        tree = trees[0] if len(trees) == 1 else Combine(tuple(trees))
        return exact(grid, And(tree, CAUSAL) if shape.causal else tree, shape.causal)[1]
    except Unsupported as e:
        return streamed_count.pairs(shape, block_q, block_k, e)
