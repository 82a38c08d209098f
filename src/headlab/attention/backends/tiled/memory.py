"""Memory of one tiled call: the formula the memory guard and the cost model read."""

from __future__ import annotations

import torch

from headlab.attention.backends.tiled.plan import BLOCK_K, BLOCK_Q
from headlab.spec.attention_spec import AttentionSpec


def working_set_bytes(
    spec: AttentionSpec, block_q: int = BLOCK_Q, block_k: int = BLOCK_K, *, backward: bool | None = None
) -> int:
    """Peak extra bytes of one call, all O(n) except the tile: the scaled query copy, K and V in
    the compute dtype (V with a ones column), output and log-sum-exp, the score tile and its
    mask (under ``causal`` the diagonal tiles' masks, kept for the call), the accumulator; with
    ``backward`` (default: ``spec.requires_grad``) the recomputation's dO copy and D, dq/dk/dv
    accumulators and two more tiles (dP, dS)."""
    c = 8 if spec.dtype == torch.float64 else 4
    B, H, Hkv, Lq, Lk, D, Dv = spec.batch, spec.heads, spec.kv_heads, spec.q_len, spec.kv_len, spec.head_dim, spec.v_dim
    rows = min(block_q, Lq) * spec.group
    cols = min(block_k, Lk)
    tile = B * Hkv * rows * cols * c
    kcopy = 0 if c == spec.itemsize else B * Hkv * Lk * D * c
    fwd = (
        B * H * Lq * D * c  # scaled q
        + kcopy
        + B * Hkv * Lk * (Dv + 1) * c  # K, [V | 1]
        + B * H * Lq * (Dv + 1) * c  # out + lse
        + tile
        + B * Hkv * rows * cols  # scores and the bool mask of a partial tile
        + B * Hkv * rows * (Dv + 1) * c  # accumulator
        + (Lq * min(block_q, Lq) if spec.causal else 0)
    )  # kept causal masks of diagonal tiles
    if backward is None:
        backward = spec.requires_grad
    if not backward:
        return fwd
    bwd = (
        B * H * Lq * (D + 1) * c  # [scale q | 0]
        + B * H * Lq * (Dv + 1) * c  # dO copy and D
        + B * H * Lq * D * c  # dq
        + B * Hkv * Lk * (D + Dv) * c  # dk, dv
        + 2 * tile
    )  # dP (then dS) beside P
    return fwd + bwd
