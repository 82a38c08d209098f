"""How many tiles (and score entries) the tiled and sparse kernels visit for a shape.

In closed form for the built-in patterns and their ``&`` / ``|`` / ``~`` combinations
(:mod:`headlab.costs.tilecount`), whatever the length: the cost model predicts without building
the block map the kernel would walk. Other masks (user functions, padding, block layouts,
BigBird, ``fixed``, strides wider than a tile) are counted on the block map itself while it has at
most :data:`MAP_BUDGET` tiles, and refused above that with the size the map would take.

    >>> from headlab import costs
    >>> shape = costs.AttentionShape(heads=1, q_len=10**12, causal=True)
    >>> tiles(shape, 128, 128) == (7812500000 * 7812500001) // 2
    True
"""

from __future__ import annotations

import torch

from headlab.costs.model import AttentionShape
from headlab.costs.patterns import And, Offset, structure
from headlab.costs.tilecount import Grid, Unsupported, count_tiles
from headlab.errors import CostModelError
from headlab.units import human_bytes

__all__ = ["MAP_BUDGET", "pairs", "plan_tiles", "tiles"]

# Block maps counted directly up to this many tiles per (batch, head) slice: a pattern's block
# classifier takes a few int64 temporaries per tile (about 30 bytes), so about 60 MiB at most.
MAP_BUDGET = 1 << 21

_CAUSAL = Offset(((0, None),))


def plan_tiles(shape: AttentionShape, block_q: int, block_k: int) -> int:
    """Tiles of the block map a kernel builds for one slice: ``ceil(Lq / bq) * ceil(Lk / bk)``."""
    return -(-shape.q_len // block_q) * -(-shape.kv_len // block_k)


def _tree(shape: AttentionShape):
    tree = structure(shape.mask)
    return And(tree, _CAUSAL) if shape.causal else tree


def _refuse(shape: AttentionShape, block_q: int, block_k: int, why: Exception) -> CostModelError:
    n = plan_tiles(shape, block_q, block_k)
    name = getattr(shape.mask, "name", "the mask")
    return CostModelError(
        f"the tiles of {name} at {shape.q_len}x{shape.kv_len} have no closed form here ({why}) and its block "
        f"map would have {n:,} tiles of {block_q}x{block_k} (about {human_bytes(30 * n)} to count); headlab "
        f"counts maps of up to {MAP_BUDGET:,} tiles: use a shorter length, or a built-in pattern "
        "(sliding_window, dilated_window, strided, global_tokens, documents, causal, and & | ~ of them)")


def _closed_form(shape: AttentionShape, block_q: int, block_k: int, causal_cut: bool) -> tuple[int, int] | None:
    try:
        tree = _tree(shape)
        return count_tiles(Grid(shape.q_len, shape.kv_len, block_q, block_k), tree, causal_cut=causal_cut)
    except Unsupported as e:
        if plan_tiles(shape, block_q, block_k) > MAP_BUDGET:
            raise _refuse(shape, block_q, block_k, e) from None
        return None


def tiles(shape: AttentionShape, block_q: int, block_k: int) -> int:
    """Non-empty tiles of the block map of ``shape.mask`` (ANDed with causal when set), summed over
    every (batch, query head): the tiles the sparse kernel computes."""
    found = _closed_form(shape, block_q, block_k, causal_cut=False)
    if found is not None:
        return found[0] * shape.batch * shape.heads
    from headlab.attention.backends import sparse as _sparse
    from headlab.attention.masks import full

    mask = _sparse.effective_mask(shape.mask, shape.causal) or full()
    bm = _sparse.block_map(mask, shape.q_len, shape.kv_len, shape.batch, shape.heads, block_q, block_k)
    return _sparse.visited_tiles(bm, shape.batch, shape.heads)


def pairs(shape: AttentionShape, block_q: int, block_k: int) -> int:
    """Score entries inside the tiles the tiled kernel visits, per (batch, head): edge tiles at their
    real size; under ``causal`` a tile's key range stops at its query block's end, as the kernel cuts it."""
    found = _closed_form(shape, block_q, block_k, causal_cut=shape.causal)
    if found is not None:
        return found[1]
    from headlab.attention.backends import tiled as _tiled

    states = _tiled.tile_states(shape.spec(), shape.mask, block_q, block_k)
    n_qb, n_kb = states.shape
    qs = torch.full((n_qb,), block_q, dtype=torch.int64)
    qs[-1] = shape.q_len - block_q * (n_qb - 1)
    ks = torch.full((n_kb,), block_k, dtype=torch.int64)
    ks[-1] = shape.kv_len - block_k * (n_kb - 1)
    if shape.causal:  # key tile [j0, j1) cut at the query block's end i1 (top-left causal)
        i1 = torch.cumsum(qs, 0)
        j0 = torch.arange(n_kb, dtype=torch.int64) * block_k
        area = qs[:, None] * (torch.minimum(j0[None, :] + ks[None, :], i1[:, None]) - j0[None, :]).clamp(min=0)
    else:
        area = qs[:, None] * ks[None, :]
    return int((area * (states != 0)).sum())
