"""Block maps: which (query tile, key tile) pairs a kernel must visit.

A :class:`BlockMap` classifies every tile of the ``q_len x kv_len`` score matrix as

* ``EMPTY`` (0): no query in the tile may see any key in it; the kernel skips the tile,
* ``PARTIAL`` (1): some entries are visible; the kernel applies the element-wise mask,
* ``FULL`` (2): every entry is visible; the kernel skips the element-wise mask.

The tiled and sparse backends walk the same map, and the cost model counts its tiles, so
predicted FLOPs are exactly the tiles the kernel visits.

    >>> from headlab import masks
    >>> bm = block_map(masks.causal(), q_len=5, kv_len=5, block_q=2, block_k=2)
    >>> bm.state[0, 0].tolist()
    [[1, 0, 0], [2, 1, 0], [2, 2, 2]]
    >>> bm.visited_tiles(), bm.num_tiles
    (6, 9)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from headlab.errors import ConfigError
from headlab.spec.tile_states import EMPTY, FULL, PARTIAL

__all__ = ["EMPTY", "FULL", "PARTIAL", "BlockMap", "block_map", "block_rows"]

# rows of the dense mask evaluated at once when no closed form exists: bounds memory to
# about _ROW_BUDGET * kv_len booleans per (batch, head) the mask depends on.
_ROW_BUDGET = 1 << 22


@dataclass(frozen=True)
class BlockMap:
    """Tile classification of a mask. ``state`` is int8 ``(Bm, Hm, n_q_blocks, n_kv_blocks)``,
    where ``Bm``/``Hm`` are 1 when the mask does not depend on batch/head."""

    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    state: torch.Tensor

    @property
    def num_q_blocks(self) -> int:
        return self.state.shape[-2]

    @property
    def num_kv_blocks(self) -> int:
        return self.state.shape[-1]

    @property
    def num_tiles(self) -> int:
        """Tiles per (batch, head) slice, visited or not."""
        return self.num_q_blocks * self.num_kv_blocks

    def visited_tiles(self) -> int:
        """Non-empty tiles, averaged over the (batch, head) slices the map distinguishes."""
        per_slice = (self.state != EMPTY).flatten(-2).sum(-1).float()
        return int(round(per_slice.mean().item()))

    def visited_elements(self) -> int:
        """Score entries inside visited tiles (edge tiles counted at their real size), per slice."""
        qs = torch.full((self.num_q_blocks,), self.block_q, dtype=torch.float64)
        qs[-1] = self.q_len - self.block_q * (self.num_q_blocks - 1)
        ks = torch.full((self.num_kv_blocks,), self.block_k, dtype=torch.float64)
        ks[-1] = self.kv_len - self.block_k * (self.num_kv_blocks - 1)
        area = qs[:, None] * ks[None, :]
        per_slice = ((self.state != EMPTY).to(torch.float64) * area).flatten(-2).sum(-1)
        return int(round(per_slice.mean().item()))

    def density(self) -> float:
        """Share of tiles visited."""
        return self.visited_tiles() / max(1, self.num_tiles)

    @staticmethod
    def from_mask(
        mask,
        q_len: int,
        kv_len: int,
        block_q: int,
        block_k: int,
        *,
        batch: int = 1,
        heads: int = 1,
        device: torch.device | None = None,
    ) -> BlockMap:
        if block_q <= 0 or block_k <= 0:
            raise ConfigError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
        device = device or torch.device("cpu")
        hint = mask.block_hint(q_len, kv_len, block_q, block_k, device)
        if hint is not None:
            return BlockMap(q_len, kv_len, block_q, block_k, hint.to(torch.int8))
        return BlockMap(
            q_len,
            kv_len,
            block_q,
            block_k,
            _classify_dense(mask, q_len, kv_len, block_q, block_k, batch, heads, device),
        )


def _classify_dense(mask, q_len, kv_len, block_q, block_k, batch, heads, device, rows=None) -> torch.Tensor:
    """Evaluate the mask in row chunks of whole query blocks and reduce each tile to any/all
    (the tile rows ``[i0, i1)`` only, with ``rows``)."""
    i0, i1 = rows if rows is not None else (0, -(-q_len // block_q))
    n_kb = -(-kv_len // block_k)
    bm = batch if mask.batch_dependent else 1
    hm = heads if mask.head_dependent else 1
    pad_k = n_kb * block_k - kv_len
    blocks_per_chunk = max(1, _ROW_BUDGET // max(1, kv_len * block_q * bm * hm))
    out = torch.empty((bm, hm, i1 - i0, n_kb), dtype=torch.int8, device=device)
    for qb0 in range(i0, i1, blocks_per_chunk):
        qb1 = min(i1, qb0 + blocks_per_chunk)
        r0, r1 = qb0 * block_q, min(q_len, qb1 * block_q)
        dense = mask.dense(batch, heads, q_len, kv_len, device=device, rows=torch.arange(r0, r1, device=device))
        dense = dense.expand(bm, hm, r1 - r0, kv_len)
        pad_q = (qb1 - qb0) * block_q - (r1 - r0)
        # any: pad with False; all: pad with True, so padding never decides a tile
        any_t = torch.nn.functional.pad(dense, (0, pad_k, 0, pad_q), value=False)
        all_t = torch.nn.functional.pad(dense, (0, pad_k, 0, pad_q), value=True)
        shape = (bm, hm, qb1 - qb0, block_q, n_kb, block_k)
        any_b = any_t.reshape(shape).any(dim=5).any(dim=3)
        all_b = all_t.reshape(shape).all(dim=5).all(dim=3)
        out[:, :, qb0 - i0 : qb1 - i0] = torch.where(all_b, FULL, torch.where(any_b, PARTIAL, EMPTY)).to(torch.int8)
    return out


def block_rows(
    mask,
    q_len: int,
    kv_len: int,
    block_q: int,
    block_k: int,
    i0: int,
    i1: int,
    *,
    batch: int = 1,
    heads: int = 1,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The tile rows ``[i0, i1)`` of the block map of ``mask``, int8 ``(Bm, Hm, i1 - i0, n_kv_blocks)``,
    computed by the same classifier as :func:`block_map` (or the same dense evaluation) but without
    the other rows, so a map too large to hold can be walked a few rows at a time."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    hint = mask.block_hint(q_len, kv_len, block_q, block_k, device, rows=(i0, i1))
    if hint is not None:
        return hint.to(torch.int8)
    return _classify_dense(mask, q_len, kv_len, block_q, block_k, batch, heads, device, rows=(i0, i1))


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mask -> {shape key: BlockMap}


def cached_per_mask(store: weakref.WeakKeyDictionary, mask, key, build, limit: int):
    """``build()`` once per ``(mask, key)``: ``store`` maps each mask (weakly) to at most ``limit``
    shapes, and is emptied for that mask when it would hold more."""
    cache = store.get(mask)
    if cache is None:
        cache = store[mask] = {}
    value = cache.get(key)
    if value is None:
        if len(cache) > limit:
            cache.clear()
        value = cache[key] = build()
    return value


def block_map(
    mask,
    q_len: int,
    kv_len: int,
    block_q: int = 128,
    block_k: int = 128,
    *,
    batch: int = 1,
    heads: int = 1,
    device: torch.device | str | None = None,
) -> BlockMap:
    """Compile a mask function (:class:`headlab.masks.MaskFn`) to a :class:`BlockMap`, cached per
    (mask, shape): from its closed-form classifier when it has one, else by dense evaluation in
    row chunks (memory bounded by about ``2**22 * kv_len`` booleans per distinct (batch, head))."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    key = (
        q_len,
        kv_len,
        block_q,
        block_k,
        batch if mask.batch_dependent else 1,
        heads if mask.head_dependent else 1,
        str(device),
    )
    return cached_per_mask(
        _CACHE,
        mask,
        key,
        lambda: BlockMap.from_mask(mask, q_len, kv_len, block_q, block_k, batch=batch, heads=heads, device=device),
        limit=16,
    )
