"""What a KV cache holds: bytes per layer and kv head, for the ordinary cache and per-head policies.

A decoder keeps, for every layer and kv head, the keys and values of the tokens it may still attend
to: ``kept`` vectors of ``head_dim`` (keys) and ``v_dim`` (values) numbers each. The ordinary cache
keeps every token, so at ``n`` tokens it holds

    2 x layers x kv_heads x n x head_dim x bytes per number      (batch 1, v_dim = head_dim)

For SmolLM2-135M (30 layers, 3 kv heads, head dim 64) in float32 that is 46,080 bytes per token:
377,487,360 bytes (360 MiB) at 8,192 tokens. A per-head policy (``headlab.kv``) changes ``kept`` head by
head: a windowed head holds ``min(n, sink + recent)``, a dropped one 0, a SnapKV head ``min(prompt, budget)``
prompt tokens (Li et al. 2024; Ada-KV: ``min(total, heads x prompt)`` per layer, Feng et al. 2024) plus every
token after the prompt.

A quantized head (``kv.full(bits=4)``, KIVI, Liu et al. 2024) holds, besides the vectors it keeps in the
cache's dtype (the full-precision residual, the sinks), ``bits``-bit codes packed ``8 // bits`` to a byte
and their scales and zero points in the cache's dtype (:func:`layout_bytes`):

    codes:  quant_keys x head_dim x bits / 8  +  quant_values x v_dim x bits / 8
    scales: 2 x (key_groups x head_dim  +  quant_values x v_dim / group) x bytes per number

so 4-bit keys and values with groups of 32 take 5/16 of the float16 bytes (about 3.2x less) once the
full-precision residual is small against the context.

    >>> from headlab.costs.kv import kv_cache_bytes, full_cache_bytes
    >>> full_cache_bytes(layers=30, kv_heads=3, tokens=8192, head_dim=64, dtype="float32")
    377487360
    >>> kv_cache_bytes([[8192, 260, 0]], head_dim=64, dtype="float16")   # one layer: full, windowed, dropped
    2163712
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import headlab.checks as checks
from headlab.costs.model import parse_dtype
from headlab.errors import ConfigError

__all__ = ["kv_cache_bytes", "full_cache_bytes", "policy_cache_bytes", "policy_peak_bytes", "layout_bytes"]


def kv_cache_bytes(
    kept: Sequence[Sequence[int]], *, head_dim: int, dtype="float32", v_dim: int | None = None, batch: int = 1
) -> int:
    """Bytes of keys and values held, given ``kept[layer][kv_head]`` token counts."""
    size = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    v_dim = head_dim if v_dim is None else v_dim
    if head_dim <= 0 or v_dim <= 0 or batch <= 0:
        raise ConfigError(f"head_dim, v_dim and batch must be positive, got {head_dim}, {v_dim}, {batch}")
    if not isinstance(kept, (list, tuple)):  # None: a TypeError from the loop before
        raise ConfigError(
            f"kept must be token counts per layer and kv head, kept[layer][kv_head], got {type(kept).__name__}"
        )
    total = 0
    for layer in kept:
        for n in layer:
            if not checks.is_int(n):  # 1.5 tokens was costed as 96.0 bytes
                raise ConfigError(f"a kv head keeps a whole number of tokens, got {n!r}")
            if n < 0:
                raise ConfigError(f"a kv head cannot keep {n} tokens")
            total += n
    return batch * total * (head_dim + v_dim) * size


def full_cache_bytes(
    *, layers: int, kv_heads: int, tokens: int, head_dim: int, dtype="float32", v_dim: int | None = None, batch: int = 1
) -> int:
    """The ordinary cache: every layer's every kv head keeps all ``tokens``."""
    for name, val in (("layers", layers), ("kv_heads", kv_heads)):  # a negative count would give 0 bytes, not an error
        checks.positive_int(name, val)
    return kv_cache_bytes([[tokens] * kv_heads] * layers, head_dim=head_dim, dtype=dtype, v_dim=v_dim, batch=batch)


def layout_bytes(layout, *, head_dim: int, dtype="float32", v_dim: int | None = None, batch: int = 1) -> int:
    """Bytes one kv head holds, given what it holds (a :class:`headlab.kv.Layout`, or anything with its fields:
    ``full_keys``, ``full_values``, ``quant_keys``, ``quant_values``, ``key_groups``, ``bits``, ``group``,
    ``compensation``, ``positions``): vectors in ``dtype``, packed codes, a scale and a zero point per group in
    ``dtype``, and 8 bytes per int64 position held (one per head, whatever the batch)."""
    size = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    v_dim = head_dim if v_dim is None else v_dim
    if head_dim <= 0 or v_dim <= 0 or batch <= 0:
        raise ConfigError(f"head_dim, v_dim and batch must be positive, got {head_dim}, {v_dim}, {batch}")
    counts = (
        layout.full_keys,
        layout.full_values,
        layout.quant_keys,
        layout.quant_values,
        layout.key_groups,
        layout.compensation,
    )
    if any(c < 0 for c in counts):
        raise ConfigError(f"a kv head cannot hold a negative count: {layout}")
    plain = (layout.full_keys + layout.compensation) * head_dim + (layout.full_values + layout.compensation) * v_dim
    total = plain * size
    if layout.quant_keys or layout.quant_values:
        bits, group = layout.bits, layout.group
        if bits not in (8, 4, 2) or head_dim * bits % 8 or v_dim * bits % 8 or v_dim % group:
            raise ConfigError(f"{bits}-bit codes in groups of {group} do not fit head_dim {head_dim}, v_dim {v_dim}")
        total += (layout.quant_keys * head_dim + layout.quant_values * v_dim) * bits // 8
        total += 2 * (layout.key_groups * head_dim + layout.quant_values * (v_dim // group)) * size
    return batch * total + 8 * getattr(layout, "positions", 0)


def policy_cache_bytes(
    policy,
    *,
    kv_heads: Sequence[int],
    tokens: int,
    head_dim: int,
    dtype="float32",
    v_dim: int | None = None,
    batch: int = 1,
    prompt: int | None = None,
) -> int:
    """The cache a per-head policy holds after ``tokens`` tokens: the sum of :func:`layout_bytes` over its kv heads
    (``policy``: a :class:`headlab.kv.Policy`, or anything with ``kept(tokens, kv_heads) -> [[count per kv head]
    per layer]``, counted at the cache's dtype).

    ``prompt``: how many of the ``tokens`` came as the prefill (None: all of them, a context compressed whole).
    Only SnapKV's rules read it: they keep ``min(prompt, budget)`` prompt tokens per head (Ada-KV: ``min(total,
    heads x prompt)`` per layer) and every token after the prompt."""
    if not hasattr(policy, "layouts"):
        return kv_cache_bytes(
            policy.kept(tokens, list(kv_heads)), head_dim=head_dim, dtype=dtype, v_dim=v_dim, batch=batch
        )
    if hasattr(policy, "check_shape"):
        policy.check_shape(list(kv_heads), head_dim, v_dim)
    return sum(
        layout_bytes(lay, head_dim=head_dim, dtype=dtype, v_dim=v_dim, batch=batch)
        for layer in policy.layouts(tokens, list(kv_heads), prompt)
        for lay in layer
    )


def policy_peak_bytes(
    policy,
    *,
    kv_heads: Sequence[int],
    prompt: int,
    tokens: int,
    head_dim: int,
    dtype="float32",
    v_dim: int | None = None,
    batch: int = 1,
) -> int:
    """The most a per-head cache holds while it takes a ``prompt``-token prefill and then one token at a time up
    to ``tokens``, counted after each layer's step as :attr:`headlab.decode.HeadCache.peak_bytes` is.

    A 16-bit policy only grows, so this is :func:`policy_cache_bytes` at ``tokens`` (with ``prompt``: SnapKV's
    rules select from the prompt inside each layer's prefill step, so the whole prompt of one layer is held only
    within that step and is not counted, as the cache does not count it); a quantized one shrinks
    when a layer's full-precision key residual is quantized (KIVI), so its peak can come earlier, or in the
    middle of a step (layers before the one that shrank already grown)."""
    if not hasattr(policy, "layouts"):
        return policy_cache_bytes(
            policy, kv_heads=kv_heads, tokens=tokens, head_dim=head_dim, dtype=dtype, v_dim=v_dim, batch=batch
        )
    checks.int_in_range(
        "prompt", prompt, 1, tokens, message="prompt={value} and tokens={high}: give 1 <= prompt <= tokens"
    )
    kvh = list(kv_heads)
    if hasattr(policy, "check_shape"):
        policy.check_shape(kvh, head_dim, v_dim)

    def per_layer(t: int) -> list[int]:
        return [
            sum(layout_bytes(lay, head_dim=head_dim, dtype=dtype, v_dim=v_dim, batch=batch) for lay in layer)
            for layer in policy.layouts(t, kvh, prompt)
        ]

    prev = per_layer(prompt)
    peak = run = sum(prev)
    for t in range(prompt + 1, tokens + 1):
        cur = per_layer(t)
        for before, after in zip(prev, cur):
            run += after - before
            peak = max(peak, run)
        prev = cur
    return peak
