"""Per-head statistics of ring attention, without any n x n map: :func:`ring_attention_stats`.

Two trips round the ring. The first carries K and keeps, per query row, an online softmax state
(running maximum m, normaliser l, ``sum e s`` and ``sum e |i - j|`` with ``e = exp(s - m)``, the
best score and its global key): lse, entropy ``lse - E_p[s]``, the maximum weight and its key, and
the mean attended distance follow exactly. The second carries K with a per-key accumulator of
``sum_i P_ij`` (P from the final maximum and normaliser), which arrives back at the key's owner: the mass each key
receives, summed over every rank's queries. Results equal :func:`headlab.attention_stats` on the
unsharded tensors (tested with 2, 3 and 4 ranks).
"""

from __future__ import annotations

import math

import torch

from headlab.attention.stats import AttentionStats, attention_stats
from headlab.distributed import comm
from headlab.distributed.kernels import probabilities, score_tiles, tile_dtype
from headlab.distributed.layout import Layout, chunks
from headlab.distributed.ring import check_inputs, ring_pairs

RING_STATS = ("lse", "entropy", "max_weight", "argmax", "mean_distance", "received")


def _first_pass(q, k, pair, qpos, kpos, scale, st) -> None:
    """Fold one pair's scores into the online state ``st`` (dict of (B, H, ql) tensors, updated in place)."""
    B, H = q.shape[:2]
    ct = tile_dtype(q.dtype)
    for r0, r1, c0, c1, S, _seen in score_tiles(q, k, pair, scale, ct):
        S = S.reshape(B, H, r1 - r0, c1 - c0).double()  # (B, H, bq, bk), -inf where hidden
        m_old = st["m"][:, :, r0:r1]
        tmax, targ = S.max(-1)
        m_new = torch.maximum(m_old, tmax)
        live = torch.isfinite(m_new)
        m_safe = torch.where(live, m_new, torch.zeros_like(m_new))
        alpha = torch.where(live, torch.exp(m_old - m_safe), torch.zeros_like(m_new))
        e = torch.exp(S - m_safe.unsqueeze(-1))  # 0 where hidden
        gi = qpos[r0:r1].double().view(1, 1, -1, 1)
        gj = kpos[c0:c1].double().view(1, 1, 1, -1)
        for name, add in (
            ("l", e.sum(-1)),
            ("a", torch.where(e > 0, e * S, torch.zeros_like(e)).sum(-1)),
            ("c", (e * (gi - gj).abs()).sum(-1)),
        ):
            st[name][:, :, r0:r1] = st[name][:, :, r0:r1] * alpha + add
        st["m"][:, :, r0:r1] = m_new
        better = tmax > st["best"][:, :, r0:r1]
        st["best"][:, :, r0:r1] = torch.where(better, tmax, st["best"][:, :, r0:r1])
        st["arg"][:, :, r0:r1] = torch.where(better, kpos[c0:c1][targ], st["arg"][:, :, r0:r1])


def ring_attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    mask=None,
    scale: float | None = None,
    layout: Layout = "contiguous",
    group=None,
    stats=RING_STATS,
) -> AttentionStats:
    """Statistics of ring attention for this rank's shard (same fields as :func:`headlab.attention_stats`).

    ``lse``, ``entropy``, ``max_weight``, ``argmax`` (a *global* key position), ``mean_distance``
    ``(B, H, n / W)`` for this rank's queries; ``received`` ``(B, H, n / W)`` for this rank's keys, summed
    over every rank's queries. Arguments as in :func:`~headlab.distributed.ring_attention`.
    """
    check_inputs(q, k, k, dropout_p=0.0, layout=layout)
    want = set(stats)
    unknown = want - set(RING_STATS)
    if unknown:
        from headlab.errors import ConfigError

        raise ConfigError(f"unknown ring statistics {sorted(unknown)}; choose from {', '.join(RING_STATS)}")
    rank, world_size = comm.world(group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if world_size == 1:
        return attention_stats(q, k, mask=mask, causal=causal, scale=scale, stats=sorted(want))
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
        layout=layout,
        causal=int(causal),
        masked=int(mask is not None),
    )
    n = q.shape[2] * world_size
    ring = comm.Ring(rank, world_size, group)
    B, H, nq, _ = q.shape
    ct = torch.float64  # the statistics' accumulators
    st = {name: torch.zeros(B, H, nq, dtype=ct, device=q.device) for name in ("l", "a", "c")}
    st["m"] = torch.full((B, H, nq), -math.inf, dtype=ct, device=q.device)
    st["best"] = torch.full((B, H, nq), -math.inf, dtype=ct, device=q.device)
    st["arg"] = torch.full((B, H, nq), -1, dtype=torch.int64, device=q.device)

    def global_positions(r):
        pieces = chunks(n, rank=r, world_size=world_size, layout=layout)
        return torch.cat([torch.arange(s, s + ln, device=q.device) for s, ln in pieces])

    qpos_all = global_positions(rank)
    kk = k.contiguous()
    for step in range(world_size):
        src = (rank - step) % world_size
        pending = ring.start(kk) if step < world_size - 1 else None
        kpos_all = global_positions(src)
        for qs, ks, pair in ring_pairs(n, rank, src, world_size, layout, causal, mask):
            sub = {name: t[:, :, qs] for name, t in st.items()}  # views, updated in place
            _first_pass(q[:, :, qs], kk[:, :, ks], pair, qpos_all[qs], kpos_all[ks], scale, sub)
        if pending is not None:
            kk, reqs = pending
            ring.finish(reqs)
    live = st["l"] > 0
    l_safe = torch.where(live, st["l"], torch.ones_like(st["l"]))
    lse = torch.where(live, st["m"] + torch.log(l_safe), torch.full_like(st["l"], -math.inf))
    zero = torch.zeros_like(lse)
    fields: dict[str, torch.Tensor | None] = {"visible": live, "lse": lse if "lse" in want else None}
    if "entropy" in want:
        fields["entropy"] = torch.where(live, lse - st["a"] / l_safe, zero)
    if "mean_distance" in want:
        fields["mean_distance"] = torch.where(live, st["c"] / l_safe, zero)
    if "max_weight" in want:
        fields["max_weight"] = torch.where(live, torch.exp(st["best"] - torch.where(live, lse, zero)), zero)
    if "argmax" in want:
        fields["argmax"] = torch.where(live, st["arg"], torch.full_like(st["arg"], -1))
    if "received" in want:
        inv_l = torch.where(live, 1.0 / l_safe, torch.zeros_like(l_safe))
        fields["received"] = _received(q, k, st["m"], inv_l, n, rank, world_size, layout, causal, mask, scale, ring, ct)
    return AttentionStats(**fields)  # type: ignore[arg-type]  # mypy reads **dict against every field, the str method too


def _received(q, k, m, inv_l, n, rank, world_size, layout, causal, mask, scale, ring, ct) -> torch.Tensor:
    """Second trip: ``sum_i P_ij`` per key (``P = exp(s - m) / l``), accumulated as the keys travel and
    returned to their owner."""
    B, H = q.shape[:2]
    Hkv = k.shape[1]
    G = H // Hkv
    kk = k.contiguous()
    acc = None
    for step in range(world_size):
        src = (rank - step) % world_size
        pending = ring.start(kk) if step < world_size - 1 else None
        mine = torch.zeros(B, H, k.shape[2], dtype=ct, device=q.device)
        for qs, ks, pair in ring_pairs(n, rank, src, world_size, layout, causal, mask):
            col, mq, iq = mine[:, :, ks], m[:, :, qs], inv_l[:, :, qs]
            for r0, r1, c0, c1, S, _seen in score_tiles(q[:, :, qs], kk[:, :, ks], pair, scale, tile_dtype(q.dtype)):
                shape = (B, Hkv, G, r1 - r0, 1)
                P = probabilities(S.double(), mq[:, :, r0:r1].reshape(shape), iq[:, :, r0:r1].reshape(shape))
                col[:, :, c0:c1] += P.sum(-2).reshape(B, Hkv * G, c1 - c0)
        if acc is not None:
            buf, reqs = acc
            ring.finish(reqs)
            mine += buf
        acc = ring.start(mine, tag=1)
        if pending is not None:
            kk, reqs = pending
            ring.finish(reqs)
    assert acc is not None  # the loop above ran at least once
    home, reqs = acc
    ring.finish(reqs)
    return home
