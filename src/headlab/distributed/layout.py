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

import torch

# the layouts' arithmetic is pure: it lives with the ring's cost formula, which reads it too
from headlab.costs.ring import LAYOUTS, MIN_BLOCK_BYTES, Layout, check_layout, chunks, kv_heads_per_trip
from headlab.errors import ConfigError, ShapeError

__all__ = [
    "LAYOUTS",
    "MIN_BLOCK_BYTES",
    "Layout",
    "check_layout",
    "chunks",
    "kv_heads_per_trip",
    "positions",
    "shard",
    "unshard",
]


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
    out: list = [None] * (W if layout == "contiguous" else 2 * W)  # every slot is filled below
    for r, s in enumerate(shards):
        offset = 0
        for start, ln in chunks(n, rank=r, world_size=W, layout=layout):
            out[start // ln] = s.narrow(dim, offset, ln)
            offset += ln
    return torch.cat(out, dim=dim)
