"""What a KV cache holds: bytes per layer and kv head, for the ordinary cache and per-head policies.

A decoder keeps, for every layer and kv head, the keys and values of the tokens it may still attend
to: ``kept`` vectors of ``head_dim`` (keys) and ``v_dim`` (values) numbers each. The ordinary cache
keeps every token, so at ``n`` tokens it holds

    2 x layers x kv_heads x n x head_dim x bytes per number      (batch 1, v_dim = head_dim)

For SmolLM2-135M (30 layers, 3 kv heads, head dim 64) in float32 that is 46,080 bytes per token:
377,487,360 bytes (360 MiB) at 8,192 tokens. A per-head policy (``headlab.kv``) changes ``kept`` head by
head: a windowed head holds ``min(n, sink + recent)``, a dropped one 0.

    >>> from headlab.costs.kv import kv_cache_bytes, full_cache_bytes
    >>> full_cache_bytes(layers=30, kv_heads=3, tokens=8192, head_dim=64, dtype="float32")
    377487360
    >>> kv_cache_bytes([[8192, 260, 0]], head_dim=64, dtype="float16")   # one layer: full, windowed, dropped
    2163712
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from headlab.costs.model import parse_dtype
from headlab.errors import ConfigError

__all__ = ["kv_cache_bytes", "full_cache_bytes", "policy_cache_bytes"]


def kv_cache_bytes(kept: Sequence[Sequence[int]], *, head_dim: int, dtype="float32", v_dim: int | None = None,
                   batch: int = 1) -> int:
    """Bytes of keys and values held, given ``kept[layer][kv_head]`` token counts."""
    size = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    v_dim = head_dim if v_dim is None else v_dim
    if head_dim <= 0 or v_dim <= 0 or batch <= 0:
        raise ConfigError(f"head_dim, v_dim and batch must be positive, got {head_dim}, {v_dim}, {batch}")
    total = 0
    for layer in kept:
        for n in layer:
            if n < 0:
                raise ConfigError(f"a kv head cannot keep {n} tokens")
            total += n
    return batch * total * (head_dim + v_dim) * size


def full_cache_bytes(*, layers: int, kv_heads: int, tokens: int, head_dim: int, dtype="float32",
                     v_dim: int | None = None, batch: int = 1) -> int:
    """The ordinary cache: every layer's every kv head keeps all ``tokens``."""
    return kv_cache_bytes([[tokens] * kv_heads] * layers, head_dim=head_dim, dtype=dtype, v_dim=v_dim, batch=batch)


def policy_cache_bytes(policy, *, kv_heads: Sequence[int], tokens: int, head_dim: int, dtype="float32",
                       v_dim: int | None = None, batch: int = 1) -> int:
    """The cache a per-head policy holds after ``tokens`` tokens (``policy``: anything with
    ``kept(tokens, kv_heads) -> [[count per kv head] per layer]``, such as :class:`headlab.kv.Policy`)."""
    return kv_cache_bytes(policy.kept(tokens, list(kv_heads)), head_dim=head_dim, dtype=dtype, v_dim=v_dim, batch=batch)
