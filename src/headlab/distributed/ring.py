"""Ring attention: exact attention over a sequence sharded across ranks (Liu et al. 2023).

Each of W ranks holds a shard of q, k and v along the sequence. The K/V shards travel round the ring
in W steps (each rank sends to ``rank + 1`` and receives from ``rank - 1`` while it computes on the
shard it holds); every key tile that arrives continues the rank's online softmax (running maximum,
normaliser and accumulator), which is the exact merge of partial results by their log-sum-exps. The backward
pass goes round again: dQ stays local, and dK/dV accumulators travel with the K/V shard they belong
to, arriving back at their owner after the last step. Nothing ``n x n`` is held; each rank's memory is
O(n / W) plus one tile.

    # torchrun --nproc-per-node 2 my_script.py
    out = headlab.distributed.ring_attention(q_shard, k_shard, v_shard, causal=True, layout="zigzag")
"""

from __future__ import annotations

import logging
import math
from typing import cast

import torch

from headlab.attention.core import attention
from headlab.costs.ring import split_of
from headlab.distributed import comm
from headlab.distributed.kernels import (
    native_pair_backward,
    native_pair_update,
    native_takes,
    pair_backward,
    pair_update,
    relation,
    tile_dtype,
)
from headlab.distributed.layout import Layout, check_layout, chunks, kv_heads_per_trip
from headlab.errors import ConfigError, DTypeError, ShapeError

log = logging.getLogger("headlab.distributed")


def finish_state(m, l, acc):
    """``(out, lse, inv_l)`` from the online-softmax state; rows that saw no key give zeros and ``lse = -inf``.
    ``out`` is ``acc`` itself, normalised in place (no second buffer of the output's size)."""
    seen = l > 0
    l_safe = torch.where(seen, l, torch.ones_like(l))
    inv_l = torch.where(seen, 1.0 / l_safe, torch.zeros_like(l))
    lse = torch.where(seen, m.double() + torch.log(l_safe), torch.full_like(l, -math.inf))
    out = acc.mul_(inv_l.to(acc.dtype).unsqueeze(-1))
    return out, lse, inv_l.to(acc.dtype)


def pieces(n: int, rank: int, world_size: int, layout: str, split: int) -> list[list[tuple[int, int, int]]]:
    """``rank``'s shard as its chunks, each cut into ``split`` equal pieces ``(global start, length, offset in
    the shard)``."""
    out, off = [], 0
    for c0, cl in chunks(n, rank=rank, world_size=world_size, layout=cast(Layout, layout)):  # checked by the caller
        pl = cl // split
        out.append([(c0 + t * pl, pl, off + t * pl) for t in range(split)])
        off += cl
    return out


def ring_pairs(
    n: int, rank: int, src: int, world_size: int, layout: str, causal: bool, mask, split: int = 1, part: int = 0
):
    """(query slice of the shard, key slice of the trip's block, Pair) for every piece of this rank's queries
    against the pieces ``part`` of ``src``'s chunks (the block a trip carries, in chunk order)."""
    out = []
    keys = [chunk[part] for chunk in pieces(n, src, world_size, layout, split)]
    for chunk in pieces(n, rank, world_size, layout, split):
        for q0, ql, q_off in chunk:
            k_off = 0
            for k0, kl, _ in keys:
                p = relation(q0, ql, k0, kl, causal=causal, mask=mask, n=n)
                if p.kind != "skip":
                    out.append((slice(q_off, q_off + ql), slice(k_off, k_off + kl), p))
                k_off += kl
    return out


def trip_kv_heads(k: torch.Tensor, n: int, world_size: int, layout: str) -> int:
    """kv heads per trip for this rank: as few as keep a K block at ``MIN_BLOCK_BYTES``
    (:func:`headlab.distributed.layout.kv_heads_per_trip`), but enough that the compiled kernel's
    backward, whose work units are the (batch, kv head) pairs of a trip, has one per CPU thread. The
    ranks agree on it before any work (it depends on each rank's thread count)."""
    B, Hkv, nk, d = k.shape
    size = kv_heads_per_trip(B, Hkv, nk // split_of(n, world_size, layout), d, k.element_size())
    threads = torch.get_num_threads() if k.device.type == "cpu" else 1
    return min(Hkv, max(size, -(-threads // B)))


def trips(
    k: torch.Tensor, heads: int, n: int, world_size: int, layout: str, size: int | None = None
) -> list[tuple[slice, slice, int, list]]:
    """``(query heads, kv heads, part, the part's slices of the shard)``: what goes round the ring, one trip
    after the other.

    The ring runs once per group of kv heads (with their query heads) and per part: trip ``t`` carries
    piece ``t`` of every chunk of the layout (:func:`pieces`; half of each zigzag chunk, so every step
    stays balanced across ranks as the whole zigzag shard is). What a rank holds in flight at a time
    (the incoming K/V block, the dK/dV accumulators) is one trip's, not the whole shard's, which is
    what lets a rank's memory fall as 1/W. Bytes sent are the same as one trip with everything. A
    group holds ``size`` kv heads (default :func:`trip_kv_heads`: one on long shards and one thread)."""
    Hkv = k.shape[1]
    split = split_of(n, world_size, layout)
    mine = pieces(n, 0, world_size, layout, split)  # every rank's pieces have these offsets and lengths
    size = size or trip_kv_heads(k, n, world_size, layout)
    G = heads // Hkv
    return [
        (
            slice(h0 * G, min(Hkv, h0 + size) * G),
            slice(h0, min(Hkv, h0 + size)),
            t,
            [slice(chunk[t][2], chunk[t][2] + chunk[t][1]) for chunk in mine],
        )
        for h0 in range(0, Hkv, size)
        for t in range(split)
    ]


def _gather(t: torch.Tensor, where: list[slice]) -> torch.Tensor:
    """The trip's block of this rank: the pieces ``where`` of ``t`` (B, h, shard, d) along dim 2 (a view for one)."""
    return t[:, :, where[0]] if len(where) == 1 else torch.cat([t[:, :, w] for w in where], 2)


def _scatter(dst: torch.Tensor, where: list[slice], block: torch.Tensor) -> None:
    """Write a trip's block back into ``dst``'s pieces (the inverse of :func:`_gather`)."""
    off = 0
    for w in where:
        ln = w.stop - w.start
        dst[:, :, w] = block[:, :, off : off + ln]
        off += ln


def _ring_forward(
    q, k, v, causal, mask, scale, layout, ring, on_kernel: bool, m, l, acc, split: int, part: int
) -> None:
    """One trip round the ring (``k``, ``v``: this rank's block of the trip, see :func:`trips`): fold every
    block into the state (m, l, acc), in place."""
    n = q.shape[2] * ring.world_size
    kk, vv = k, v
    for step in range(ring.world_size):
        src = (ring.rank - step) % ring.world_size
        pending = ring.start_pair(kk, vv) if step < ring.world_size - 1 else None  # overlaps the compute
        for qs, ks, pair in ring_pairs(n, ring.rank, src, ring.world_size, layout, causal, mask, split, part):
            if on_kernel and pair.kind in ("full", "causal"):
                native_pair_update(
                    q[:, :, qs],
                    kk[:, :, ks],
                    vv[:, :, ks],
                    pair.kind == "causal",
                    scale,
                    m[:, :, qs],
                    l[:, :, qs],
                    acc[:, :, qs],
                )
            else:
                pair_update(
                    q[:, :, qs], kk[:, :, ks], vv[:, :, ks], pair, scale, m[:, :, qs], l[:, :, qs], acc[:, :, qs]
                )
        if pending is not None:
            kk, vv = ring.finish_pair(pending)


def _ring_backward(
    q, k, v, dout, m, inv_l, log_l, D, causal, mask, scale, layout, ring, on_kernel: bool, dq, split: int, part: int
):
    """One backward trip: adds into ``dq`` (tile precision) and returns this rank's ``(dk, dv)`` of the
    trip's block.

    The dK/dV accumulators travel with their block: at each step the accumulator of the block this
    rank holds arrives from behind (with every earlier rank's share), this rank adds its own and sends
    it on; the last send takes it home. It is received before the step's work rather than during it,
    so a rank never holds more than one accumulator besides the one it is adding into (the K/V blocks
    still travel during the work)."""
    n = q.shape[2] * ring.world_size
    ct = dq.dtype
    kk, vv = k, v
    incoming = None  # the dK | dV accumulators of the block this rank will hold next, arriving from behind
    for step in range(ring.world_size):
        src = (ring.rank - step) % ring.world_size
        pending = ring.start_pair(kk, vv) if step < ring.world_size - 1 else None
        if incoming is None:  # this rank's own block: its accumulators start here
            mk, mv = torch.zeros(k.shape, dtype=ct, device=k.device), torch.zeros(v.shape, dtype=ct, device=v.device)
        else:
            mk, mv = ring.finish_pair(incoming)  # src's accumulators, with the shares of the ranks before
        for qs, ks, pair in ring_pairs(n, ring.rank, src, ring.world_size, layout, causal, mask, split, part):
            if on_kernel and pair.kind in ("full", "causal"):
                native_pair_backward(
                    q[:, :, qs],
                    kk[:, :, ks],
                    vv[:, :, ks],
                    dout[:, :, qs],
                    m[:, :, qs],
                    log_l[:, :, qs],
                    D[:, :, qs],
                    pair.kind == "causal",
                    scale,
                    dq[:, :, qs],
                    mk[:, :, ks],
                    mv[:, :, ks],
                )
            else:
                pair_backward(
                    q[:, :, qs],
                    kk[:, :, ks],
                    vv[:, :, ks],
                    dout[:, :, qs],
                    m[:, :, qs],
                    inv_l[:, :, qs],
                    D[:, :, qs],
                    pair,
                    scale,
                    dq[:, :, qs],
                    mk[:, :, ks],
                    mv[:, :, ks],
                )  # views: in place
        incoming = ring.start_pair(mk, mv, tag=2)  # on with their block; the last send takes them home
        del mk, mv
        if pending is not None:
            kk, vv = ring.finish_pair(pending)
    return ring.finish_pair(incoming)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, mask, scale, layout, ring, size):
        ct = tile_dtype(q.dtype)
        B, H, nq, _ = q.shape
        on_kernel = native_takes(q, k, v)
        # the rank's online softmax over every key it is sent: running max, normaliser, accumulator
        m = torch.full((B, H, nq), -math.inf, dtype=ct, device=q.device)
        l = torch.zeros(B, H, nq, dtype=torch.float64, device=q.device)
        acc = torch.zeros(B, H, nq, v.shape[-1], dtype=ct, device=q.device)
        n = nq * ring.world_size
        split = split_of(n, ring.world_size, layout)
        for qh, kh, part, where in trips(k, H, n, ring.world_size, layout, size):
            _ring_forward(
                q[:, qh],
                _gather(k[:, kh], where),
                _gather(v[:, kh], where),
                causal,
                mask,
                scale,
                layout,
                ring,
                on_kernel,
                m[:, qh],
                l[:, qh],
                acc[:, qh],
                split,
                part,
            )
        out, _lse, _inv_l = finish_state(m, l, acc)
        ctx.save_for_backward(q, k, v, out, m, l)
        ctx.args = (causal, mask, scale, layout, ring, size)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, m, l = ctx.saved_tensors
        causal, mask, scale, layout, ring, size = ctx.args
        on_kernel = native_takes(q, k, v)
        ct = out.dtype
        dq = torch.zeros(q.shape, dtype=ct, device=q.device)  # in the tile precision: every trip adds into it
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        D = (dout.to(ct) * out).sum(-1)  # (B, H, n/W), from the unrounded output
        seen = l > 0
        l_safe = torch.where(seen, l, torch.ones_like(l))
        inv_l = torch.where(seen, 1.0 / l_safe, torch.zeros_like(l)).to(ct)  # the PyTorch tiles' P = e / l
        log_l = torch.where(seen, torch.log(l_safe), torch.full_like(l, math.inf))  # the kernel's exp(s - m - log l)
        n = q.shape[2] * ring.world_size
        split = split_of(n, ring.world_size, layout)
        for qh, kh, part, where in trips(k, q.shape[1], n, ring.world_size, layout, size):
            gk, gv = _ring_backward(
                q[:, qh],
                _gather(k[:, kh], where),
                _gather(v[:, kh], where),
                dout[:, qh],
                m[:, qh],
                inv_l[:, qh],
                log_l[:, qh],
                D[:, qh],
                causal,
                mask,
                scale,
                layout,
                ring,
                on_kernel,
                dq[:, qh],
                split,
                part,
            )
            _scatter(dk[:, kh], where, gk)
            _scatter(dv[:, kh], where, gv)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None


def check_inputs(q, k, v, *, dropout_p: float, layout: str) -> None:
    check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ShapeError(
                f"{name} must be a (batch, heads, seq_shard, head_dim) tensor, got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
            )
        if not t.is_floating_point():
            raise DTypeError(f"{name} has dtype {t.dtype}; ring attention needs floating tensors")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise DTypeError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; give one dtype")
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ShapeError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit: batch, kv heads, "
            "shard length and head_dim must agree (q's heads a multiple of k's)"
        )
    if q.shape[1] % k.shape[1]:
        raise ShapeError(f"{q.shape[1]} query heads cannot share {k.shape[1]} kv heads (not a multiple)")
    if q.shape[2] != k.shape[2]:
        raise ShapeError(
            f"q's shard has {q.shape[2]} positions and k's {k.shape[2]}: ring attention is self-attention "
            "over one sharded sequence, so every shard of q, k and v has the same length"
        )
    if dropout_p:
        raise ConfigError(
            f"dropout_p={dropout_p}: ring attention does not implement dropout (the keep-masks would have "
            "to be drawn identically on every rank); use dropout_p=0, or headlab.attention on one process"
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mask=None,
    scale: float | None = None,
    layout: Layout = "contiguous",
    group=None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Exact attention over a sequence sharded along dim 2; returns this rank's output shard.

    Args:
        q: this rank's shard ``(B, H, n / W, d)``; k, v: ``(B, Hkv, n / W, d | dv)`` (query head h reads
            kv head ``h // (H // Hkv)``). Cut a full tensor with :func:`headlab.distributed.shard`.
        causal: causal attention over *global* positions (torch's ``is_causal``).
        mask: a mask function ``f(b, h, q_idx, kv_idx) -> bool`` of global positions (``headlab.masks``:
            sliding windows, documents...), combined with ``causal``; tensors are not accepted (shard
            the rule, not the map).
        scale: defaults to ``1/sqrt(d)``.
        layout: ``"contiguous"`` or ``"zigzag"`` (balanced causal work); see :mod:`headlab.distributed.layout`.
        group: the process group (default: the world). With world size 1 the local kernel runs.
        dropout_p: must be 0 (refused otherwise).

    Differentiable: the backward goes round the ring again (dK and dV travel back to their owner).
    Before any work the ranks check, with one small all-gather, that they agree on shapes, dtype,
    layout, options and torch's CPU thread count (which sets how many kv heads go round per trip, see
    :func:`trip_kv_heads`); a mismatch is a :class:`~headlab.errors.DistributedError` on every rank.
    """
    check_inputs(q, k, v, dropout_p=dropout_p, layout=layout)
    if mask is not None and (isinstance(mask, torch.Tensor) or not callable(mask)):
        raise ConfigError(
            "ring attention takes masks as functions of global positions (headlab.masks, or "
            "f(b, h, q_idx, kv_idx) -> bool); a tensor mask would have to be sharded in two dims"
        )
    rank, world_size = comm.world(group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if world_size == 1:
        log.debug("ring_attention with world size 1: running the local kernel")
        return attention(q, k, v, mask=mask, causal=causal, scale=scale, backend="tiled")
    comm.agree(
        rank,
        world_size,
        group,
        device=q.device,
        dtype=q.dtype,
        batch=q.shape[0],
        heads=q.shape[1],
        kv_heads=k.shape[1],
        shard=q.shape[2],
        head_dim=q.shape[3],
        v_dim=v.shape[3],
        layout=layout,
        causal=int(causal),
        masked=int(mask is not None),
        threads=torch.get_num_threads() if q.device.type == "cpu" else 1,
    )  # they decide the trips
    n = q.shape[2] * world_size
    chunks(n, rank=rank, world_size=world_size, layout=layout)  # the shard splits evenly
    ring = comm.Ring(rank, world_size, group)
    return _RingAttention.apply(q, k, v, causal, mask, scale, layout, ring, trip_kv_heads(k, n, world_size, layout))
