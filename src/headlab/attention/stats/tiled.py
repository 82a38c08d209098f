"""Method ``"tiled"`` of :func:`~headlab.attention.stats.attention_stats` for rows too long for
the one-pass kernel (:mod:`.fused`), or ``cache_bytes=0``: query chunks over key tiles, two
passes (online softmax, then probabilities recomputed), tiles the visibility leaves empty skipped.

Precision: ``mean_distance`` sums ``P_ij |i - j|`` directly on every tile (no ``i * mass -
sum_j P_ij j`` cancellation) into float64 accumulators; the docs promise 1e-5 at 16,384 tokens."""

from __future__ import annotations

import torch

from headlab.spec.attention_spec import AttentionSpec
from headlab.spec.tile_states import EMPTY, FULL
from headlab.spec.visibility import tile_states, visible

# The one-pass kernel (:mod:`.fused`) runs when two of its smallest units fit this many bytes.
DEFAULT_CACHE_BYTES = 64 << 20
# The automatic query chunk keeps one (B, H, block_q, block_k) tile near this many bytes.
_TILE_BYTES = 16 << 20


class _Tiles:
    """For a query range and a key range: skip the tile, or its visibility (None = all visible),
    from the call's tile states (:func:`headlab.spec.visibility.tile_states`)."""

    def __init__(self, spec: AttentionSpec, mask, block_q: int, block_k: int) -> None:
        self.spec, self.mask = spec, mask
        self.block_q, self.block_k = block_q, block_k
        self.states = tile_states(spec, mask, block_q, block_k)  # (n_qb, n_kb)

    def tile(self, r0: int, r1: int, c0: int, c1: int) -> tuple[bool, torch.Tensor | None]:
        st = int(self.states[r0 // self.block_q, c0 // self.block_k])
        if st == EMPTY:
            return True, None
        if st == FULL:
            return False, None
        return False, visible(self.spec, self.mask, (r0, r1), (c0, c1))


def auto_block_q(spec: AttentionSpec, block_k: int, itemsize: int) -> int:
    """Query rows per chunk: a power of two that keeps one (B, H, block_q, block_k) tile near 16 MiB."""
    per_row = spec.batch * spec.heads * min(block_k, spec.kv_len) * itemsize
    bq = max(16, _TILE_BYTES // max(1, per_row))
    bq = 1 << (bq.bit_length() - 1)
    return min(bq, 1024, max(16, 1 << (spec.q_len - 1).bit_length()))


def tiled_stats(
    q,
    k,
    v,
    spec: AttentionSpec,
    mask,
    scale: float,
    want: set[str],
    ct: torch.dtype,
    block_q: int,
    block_k: int,
    score_mod=None,
):
    B, H, Lq, D = q.shape
    Hkv, G, Lk = spec.kv_heads, spec.group, spec.kv_len
    dev = q.device
    vis_of = _Tiles(spec, mask, block_q, block_k)

    acc = {
        "lse": torch.empty(B, H, Lq, dtype=ct, device=dev),
        "entropy": torch.zeros(B, H, Lq, dtype=ct, device=dev) if "entropy" in want else None,
        "mean_distance": torch.zeros(B, H, Lq, dtype=ct, device=dev) if "mean_distance" in want else None,
        "received": torch.zeros(B, H, Lk, dtype=ct, device=dev) if "received" in want else None,
        "max_weight": torch.empty(B, H, Lq, dtype=ct, device=dev) if "max_weight" in want else None,
        "argmax": torch.empty(B, H, Lq, dtype=torch.long, device=dev) if "argmax" in want else None,
        "output": torch.zeros(B, H, Lq, v.shape[-1], dtype=ct, device=dev) if v is not None else None,
    }

    for r0 in range(0, Lq, block_q):
        r1 = min(Lq, r0 + block_q)
        n = r1 - r0
        qc = q[:, :, r0:r1].to(ct).mul(scale).view(B, Hkv, G * n, D)  # (B, Hkv, G*n, D), pre-scaled
        tiles = []
        for c0 in range(0, Lk, block_k):
            c1 = min(Lk, c0 + block_k)
            skip, vis = vis_of.tile(r0, r1, c0, c1)
            if not skip:
                tiles.append((c0, c1, vis))

        def scores(c0, c1, vis, fill=float("-inf")):
            kt = k[:, :, c0:c1].to(ct)  # (B, Hkv, w, D)
            s = torch.matmul(qc, kt.transpose(-1, -2)).view(B, H, n, c1 - c0)  # (B, H, n, w)
            if score_mod is not None:  # on the scaled scores, before the mask (as headlab.attention)
                s = score_mod(
                    s,
                    torch.arange(B, device=dev).view(B, 1, 1, 1),
                    torch.arange(H, device=dev).view(1, H, 1, 1),
                    torch.arange(r0, r1, device=dev).view(1, 1, n, 1),
                    torch.arange(c0, c1, device=dev).view(1, 1, 1, c1 - c0),
                )
            if vis is not None:
                s.masked_fill_(~vis, fill)
            return s

        _chunk_streamed(acc, tiles, scores, r0, r1, v, ct)
    return acc


def _distance_tile(p: torch.Tensor, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """``sum_j p_ij |i - j|`` over one tile, in float64: (B, H, n). The distances are exact small
    integers and every term is >= 0, so nothing cancels (``i * sum_j p_ij - sum_j p_ij j`` with
    float32 positions lost 1e-4 at 4,096 tokens)."""
    dist = (torch.arange(r0, r1, device=p.device)[:, None] - torch.arange(c0, c1, device=p.device)[None, :]).abs_()
    return (p * dist.to(p.dtype)).sum(-1, dtype=torch.float64)


def _write_dead(acc, r0, r1):
    acc["lse"][:, :, r0:r1] = float("-inf")
    for name in ("max_weight", "entropy", "mean_distance", "output"):
        if acc[name] is not None:
            acc[name][:, :, r0:r1] = 0.0
    if acc["argmax"] is not None:
        acc["argmax"][:, :, r0:r1] = -1


def _chunk_streamed(acc, tiles, scores, r0, r1, v, ct):
    """One query chunk, recomputing score tiles: pass 1 is the online softmax over the key tiles
    (lse, running max and argmax); pass 2 recomputes each tile as P = exp(S - lse)."""
    if not tiles:
        _write_dead(acc, r0, r1)
        return
    need_max = acc["max_weight"] is not None or acc["argmax"] is not None
    need_p2 = any(acc[nm] is not None for nm in ("entropy", "mean_distance", "received", "output"))
    m = l = a = None
    for c0, c1, vis in tiles:
        s = scores(c0, c1, vis)
        if m is None:
            B, H, n, _ = s.shape
            m = torch.full((B, H, n), float("-inf"), dtype=ct, device=s.device)
            l = torch.zeros_like(m)
            a = torch.full((B, H, n), -1, dtype=torch.long, device=s.device) if need_max else None
        tmax, targ = s.max(dim=-1)  # (B, H, n)
        if need_max:
            a = torch.where(tmax > m, targ + c0, a)
        m_new = torch.maximum(m, tmax)
        m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)  # rows that have seen nothing yet
        l = l * torch.exp(m - m_safe) + torch.exp(s - m_safe.unsqueeze(-1)).sum(-1)
        m = m_new
    dead = torch.isneginf(m)  # (B, H, n): rows that see no key
    lse_c = torch.where(dead, float("-inf"), m + torch.log(torch.where(dead, 1.0, l)))
    acc["lse"][:, :, r0:r1] = lse_c
    if acc["max_weight"] is not None:
        acc["max_weight"][:, :, r0:r1] = torch.where(dead, 0.0, torch.exp(m - torch.where(dead, 0.0, lse_c)))
    if acc["argmax"] is not None:
        acc["argmax"][:, :, r0:r1] = a
    if not need_p2:
        return
    lse_safe = torch.where(dead, 0.0, lse_c).unsqueeze(-1)  # (B, H, n, 1)
    ent = torch.zeros_like(m) if acc["entropy"] is not None else None
    dist = torch.zeros(m.shape, dtype=torch.float64, device=m.device) if acc["mean_distance"] is not None else None
    for c0, c1, vis in tiles:
        logp = scores(c0, c1, vis).sub_(lse_safe).clamp_(min=-1e4)  # log P; masked -> -1e4, exp is 0
        p = torch.exp(logp)  # (B, H, n, w)
        if ent is not None:
            ent -= (p * logp).sum(-1)
        del logp
        if dist is not None:
            dist += _distance_tile(p, r0, r1, c0, c1)
        if acc["received"] is not None:
            acc["received"][:, :, c0:c1] += p.sum(-2)
        if acc["output"] is not None:
            Hkv = v.shape[1]
            vt = v[:, :, c0:c1].to(ct)  # (B, Hkv, w, Dv)
            acc["output"][:, :, r0:r1] += torch.matmul(p.view(B, Hkv, -1, c1 - c0), vt).view(B, H, n, -1)
    if ent is not None:
        acc["entropy"][:, :, r0:r1] = ent
    if dist is not None:
        acc["mean_distance"][:, :, r0:r1] = dist.to(m.dtype)
