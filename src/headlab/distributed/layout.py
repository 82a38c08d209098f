"""How a sequence is cut across ranks: :func:`chunks`, :func:`shard`, :func:`unshard`.

Two layouts, for ``n`` positions on ``W`` ranks:

- ``"contiguous"``: rank r holds positions ``[r n/W, (r+1) n/W)``.
- ``"zigzag"``: the sequence is cut into ``2W`` chunks of ``n/(2W)``; rank r holds chunks ``r`` and
  ``2W-1-r``, in that order. Under causal attention every rank then has the same number of visible
  (query, key) pairs, so no rank idles (Liu et al. 2023; torch's ``context_parallel`` load balancing)::

      W = 2, n = 8          positions  0 1 | 2 3 | 4 5 | 6 7
      contiguous            rank 0: 0 1 2 3        rank 1: 4 5 6 7
      zigzag (4 chunks)     rank 0: 0 1 6 7        rank 1: 2 3 4 5

    >>> chunks(8, rank=0, world_size=2, layout="zigzag")
    [(0, 2), (6, 2)]
    >>> import torch
    >>> x = torch.arange(8).view(1, 1, 8, 1)
    >>> parts = [shard(x, rank=r, world_size=2, layout="zigzag") for r in range(2)]
    >>> parts[1].flatten().tolist()
    [2, 3, 4, 5]
    >>> torch.equal(unshard(parts, layout="zigzag"), x)
    True
"""

from __future__ import annotations

from typing import Literal

import torch

from headlab.errors import ConfigError, ShapeError

Layout = Literal["contiguous", "zigzag"]
LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return layout


def chunks(n: int, *, rank: int, world_size: int, layout: Layout = "contiguous") -> list[tuple[int, int]]:
    """The ``(global start, length)`` pieces of a length-``n`` sequence that ``rank`` holds, in order."""
    check_layout(layout)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
    parts = world_size if layout == "contiguous" else 2 * world_size
    if n % parts:
        raise ShapeError(f"a sequence of {n} positions does not split into {parts} equal chunks "
                         f"({layout} layout on {world_size} ranks); pad it to a multiple of {parts}")
    c = n // parts
    if layout == "contiguous":
        return [(rank * c, c)]
    return [(rank * c, c), ((2 * world_size - 1 - rank) * c, c)]


def positions(n: int, *, rank: int, world_size: int, layout: Layout = "contiguous") -> torch.Tensor:
    """The global positions of ``rank``'s shard, ``(n / world_size,)`` int64."""
    return torch.cat([torch.arange(s, s + ln) for s, ln in chunks(n, rank=rank, world_size=world_size, layout=layout)])


def shard(x: torch.Tensor, *, rank: int, world_size: int, dim: int = 2, layout: Layout = "contiguous") -> torch.Tensor:
    """``rank``'s shard of the full tensor ``x`` along ``dim`` (a copy, contiguous)."""
    pieces = chunks(x.shape[dim], rank=rank, world_size=world_size, layout=layout)
    return torch.cat([x.narrow(dim, s, ln) for s, ln in pieces], dim=dim).contiguous()


def unshard(shards: list[torch.Tensor], *, dim: int = 2, layout: Layout = "contiguous") -> torch.Tensor:
    """The full tensor from every rank's shard (``shards[r]`` is rank r's), along ``dim``."""
    check_layout(layout)
    W = len(shards)
    if W == 0:
        raise ConfigError("unshard needs at least one shard")
    n_local = shards[0].shape[dim]
    if any(s.shape[dim] != n_local for s in shards):
        raise ShapeError(f"shards have unequal lengths along dim {dim}: {[s.shape[dim] for s in shards]}")
    n = n_local * W
    out = [None] * (W if layout == "contiguous" else 2 * W)
    for r, s in enumerate(shards):
        offset = 0
        for start, ln in chunks(n, rank=r, world_size=W, layout=layout):
            out[start // ln] = s.narrow(dim, offset, ln)
            offset += ln
    return torch.cat(out, dim=dim)


MIN_BLOCK_BYTES = 1 << 20  # kv heads travel together until one K block reaches this (see kv_heads_per_trip)


def kv_heads_per_trip(batch: int, kv_heads: int, block_len: int, head_dim: int, itemsize: int) -> int:
    """How many kv heads go round the ring together (:func:`headlab.distributed.ring.trips`): as few as keep
    one K block of ``block_len`` positions at ``MIN_BLOCK_BYTES`` or more, so one on long shards."""
    per_head = max(1, batch * block_len * head_dim * itemsize)
    return min(kv_heads, max(1, -(-MIN_BLOCK_BYTES // per_head)))
