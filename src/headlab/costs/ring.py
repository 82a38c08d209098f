"""Cost of ring attention (:func:`headlab.distributed.ring_attention`) on R ranks: :func:`ring_cost`.

This module also holds the ring's pure arithmetic that the kernel (:mod:`headlab.distributed`) and
this formula both read: how a sequence is cut across ranks (:func:`chunks`), into how many pieces a
trip carries (:func:`split_of`), and how many kv heads travel together (:func:`kv_heads_per_trip`).

Per layer, each rank holds ``n / R`` positions of q, k, v and the output. In each of R steps it
computes its queries against one K/V block while the next block travels (sent to ``rank + 1``); the
backward pass sends the K/V blocks round once more and the dK/dV accumulators R times (the last
send takes them home). The zigzag layout gives every rank the same share of visible pairs, so the
compute per rank is ``visible pairs / R``. Hardware is an argument: a :class:`~headlab.costs.Hardware`
for the compute rate and a link bandwidth in bytes per second.

The ring holds equal shards, as the kernel does: :func:`~headlab.distributed.ring_attention` refuses a
sequence that does not cut into ``R`` equal shards (``2R`` equal chunks for zigzag), and so does
:func:`ring_cost` (a :class:`~headlab.errors.ShapeError` naming the length to pad to), rather than price
a run that cannot happen. Without a ``layout``, causal attention takes zigzag when the sequence cuts into
``2R`` chunks and contiguous otherwise (what the kernel can run); :attr:`RingCost.layout` says which.

    >>> from headlab.costs import AttentionShape
    >>> c = ring_cost(AttentionShape(heads=32, q_len=1_000_000, head_dim=128, dtype="bfloat16", causal=True), ranks=64)
    >>> c.steps, c.shard_len, c.layout, round(c.sent_forward_bytes / 2**30, 2)   # GiB sent per rank per layer
    (64, 15625, 'contiguous', 15.02)
    >>> ring_cost(AttentionShape(heads=32, q_len=1_048_576, head_dim=128, causal=True), ranks=64).layout
    'zigzag'
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, cast

import torch

import headlab.checks as checks
from headlab.costs.model import AttentionShape, Hardware, parse_dtype
from headlab.errors import ConfigError, ShapeError

__all__ = [
    "LAYOUTS",
    "MIN_BLOCK_BYTES",
    "SPLIT",
    "TILE",
    "Layout",
    "RingCost",
    "check_layout",
    "chunks",
    "kv_heads_per_trip",
    "ring_cost",
    "split_of",
]

TILE = 512  # query x key tile of the ring kernels (headlab.distributed.kernels.TILE)

# -- how the ring cuts the sequence (headlab.distributed.layout and .ring import these) ------------------------
Layout = Literal["contiguous", "zigzag"]
LAYOUTS = ("contiguous", "zigzag")
SPLIT = 2  # pieces per chunk of the layout: a trip carries piece t of every chunk (half a shard)
MIN_BLOCK_BYTES = 1 << 20  # kv heads travel together until one K block reaches this (see kv_heads_per_trip)


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return layout


def chunks(n: int, *, rank: int, world_size: int, layout: Layout = "contiguous") -> list[tuple[int, int]]:
    """The ``(global start, length)`` pieces of a length-``n`` sequence that ``rank`` holds, in order
    (the layouts are drawn in :mod:`headlab.distributed.layout`).

    >>> chunks(8, rank=0, world_size=2, layout="zigzag")
    [(0, 2), (6, 2)]
    """
    check_layout(layout)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
    parts = world_size if layout == "contiguous" else 2 * world_size
    if n % parts:
        raise ShapeError(
            f"a sequence of {n} positions does not split into {parts} equal chunks "
            f"({layout} layout on {world_size} ranks); pad it to a multiple of {parts}"
        )
    c = n // parts
    if layout == "contiguous":
        return [(rank * c, c)]
    return [(rank * c, c), ((2 * world_size - 1 - rank) * c, c)]


def split_of(n: int, world_size: int, layout: str) -> int:
    """Pieces per chunk: :data:`SPLIT` when the chunks divide evenly, else 1."""
    cl = chunks(n, rank=0, world_size=world_size, layout=cast(Layout, layout))[0][1]  # checked by the callers
    return SPLIT if cl % SPLIT == 0 else 1


def kv_heads_per_trip(batch: int, kv_heads: int, block_len: int, head_dim: int, itemsize: int) -> int:
    """How many kv heads go round the ring together (:func:`headlab.distributed.ring.trips`): as few as keep
    one K block of ``block_len`` positions at ``MIN_BLOCK_BYTES`` or more, so one on long shards."""
    per_head = max(1, batch * block_len * head_dim * itemsize)
    return min(kv_heads, max(1, -(-MIN_BLOCK_BYTES // per_head)))


# -- the cost ----------------------------------------------------------------------------------------------------
def _tile_itemsize(dtype: torch.dtype) -> int:
    return 8 if dtype == torch.float64 else 4  # tiles in float32 (float64 for float64 inputs)


@dataclass(frozen=True)
class RingCost:
    """Predicted per-rank cost of one layer of ring attention (and the totals over ``layers``)."""

    ranks: int
    steps: int  # ring steps per pass (= ranks)
    shard_len: int  # positions per rank
    forward_flops_per_rank: int  # one layer
    backward_flops_per_rank: int  # one layer (recomputation included)
    sent_forward_bytes: int  # bytes one rank sends in one layer's forward
    sent_backward_bytes: int  # ... in one layer's backward (K/V again, plus the dK/dV accumulators)
    shard_bytes: int  # this rank's q, k, v and output of one layer
    working_set_bytes: int  # peak extra memory of one layer's forward on one rank (incoming block, state, a tile)
    layers: int
    layout: str = "contiguous"  # how the sequence is cut ("zigzag" balances causal work): it sets the trips

    @property
    def sent_bytes_all_layers(self) -> int:
        return (self.sent_forward_bytes + self.sent_backward_bytes) * self.layers

    def compute_to_communication(self, hardware: Hardware, link_bandwidth: float, *, backward: bool = False) -> float:
        """One step's compute time over one step's transfer time at ``link_bandwidth`` bytes/s (above 1: the
        transfer hides behind the work). With ``backward``, the backward step (recomputation, and the
        K/V block plus the dK/dV accumulators on the wire)."""
        if link_bandwidth <= 0:
            raise ConfigError(f"link_bandwidth must be positive bytes/s, got {link_bandwidth}")
        if self.steps == 1:
            return float("inf")  # nothing is sent
        if backward:
            flops, sent = self.backward_flops_per_rank, self.sent_backward_bytes
        else:
            flops, sent = self.forward_flops_per_rank, self.sent_forward_bytes
        compute = flops / self.steps / hardware.peak_flops
        transfer = sent / (self.steps - 1) / link_bandwidth
        return compute / transfer

    def as_dict(self) -> dict:
        return {**asdict(self), "sent_bytes_all_layers": self.sent_bytes_all_layers}


def ring_cost(shape: AttentionShape, ranks: int, *, layout: str | None = None) -> RingCost:
    """Per-rank cost of ``shape`` (self-attention, ``q_len == kv_len``) on ``ranks`` ranks, in ``layout``
    (default: ``"zigzag"`` for causal attention when ``q_len`` cuts into ``2 * ranks`` equal chunks, else
    ``"contiguous"``; it changes only the working set, through how the shard is cut into trips:
    :func:`headlab.distributed.ring.trips`).

    A length the kernel cannot shard evenly in ``layout`` (not a multiple of ``ranks``, or of ``2 * ranks``
    for zigzag) is a :class:`~headlab.errors.ShapeError`, as :func:`headlab.distributed.ring_attention`
    refuses it: pad the sequence to the length the message names."""
    checks.positive_int("ranks", ranks)
    if shape.q_len != shape.kv_len:
        raise ConfigError(
            f"ring attention shards one sequence: q_len ({shape.q_len}) must equal kv_len ({shape.kv_len})"
        )
    n, R = shape.q_len, ranks
    if layout is not None:
        check_layout(layout)
    elif shape.causal and n % (2 * R) == 0:
        layout = "zigzag"
    else:
        layout = "contiguous"
    parts = R if layout == "contiguous" else 2 * R
    if n % parts:
        pad = -(-n // parts) * parts
        other = (
            "" if layout == "contiguous" or n % R else f", or use layout='contiguous' ({n:,} splits into {R} shards)"
        )
        raise ShapeError(
            f"ring attention holds equal shards: {n:,} positions do not cut into {parts} equal chunks "
            f"({layout} layout on {R} ranks), so headlab.distributed.ring_attention refuses them; pad the "
            f"sequence to {pad:,} positions{other}"
        )
    local = n // R
    B, H, Hkv, d, dv, s = shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.v_dim, shape.itemsize
    ts = _tile_itemsize(parse_dtype(shape.dtype))  # parse_dtype: a no-op once the shape is built
    pairs = shape.visible_pairs() * B * H  # visible (query, key) pairs of one layer, all heads
    per_rank = pairs // R
    fwd = 2 * per_rank * (d + dv)  # S = q k^T (2d per pair) and P V (2dv)
    bwd = 2 * per_rank * (2 * d + 2 * dv + d)  # S again, dP = dO V^T, dV, dQ, dK
    block = B * Hkv * local * (d + dv) * s  # one K/V block, every head
    acc_block = B * Hkv * local * (d + dv) * ts  # the dK/dV accumulators travel in the tile precision
    # in flight at a time: one trip's K/V block (the heads go round a group at a time), the softmax
    # state of every query row, and the tiles of one step
    split = split_of(n, R, layout)
    trip = block * kv_heads_per_trip(B, Hkv, local // split, d, s) // Hkv // split  # a trip carries 1/split
    working = trip + B * H * local * (ts + 8 + dv * ts) + 3 * B * H * TILE * TILE * ts
    return RingCost(
        ranks=R,
        steps=R,
        shard_len=local,
        forward_flops_per_rank=fwd,
        backward_flops_per_rank=bwd,
        sent_forward_bytes=(R - 1) * block,
        sent_backward_bytes=(R - 1) * block + R * acc_block,
        shard_bytes=B * local * s * (H * (d + dv) + Hkv * (d + dv)),
        working_set_bytes=working,
        layers=shape.layers,
        layout=layout,
    )
