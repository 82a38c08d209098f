"""What one kv head holds (:class:`Layout`), as its rule says, and where KIVI's precision puts the quantized part
(:func:`key_boundary`, :func:`value_boundary`, :func:`held_layout`); re-exported by :mod:`headlab.kv`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout", "held_layout", "key_boundary", "value_boundary"]


@dataclass(frozen=True)
class Layout:
    """What one kv head holds after ``tokens`` tokens (one batch row), as its rule says; :func:`headlab.costs.kv.
    layout_bytes` turns it into bytes, and the cache's tensors come to the same (a test checks them).

    ``full_keys``/``full_values``: vectors in the cache's dtype (sinks, the full-precision residual);
    ``quant_keys``/``quant_values``: vectors stored as ``bits``-bit codes, packed ``8 // bits`` to a byte;
    ``key_groups``: ``(scale, zero)`` pairs per key channel (one per ``group`` quantized tokens); each quantized
    value has ``v_dim / group`` pairs; ``compensation``: 0 or 1 extra key/value pair (RazorAttention's mean);
    ``positions``: int64 positions held, one per key, by a head whose keys are a subset the data chose (SnapKV's:
    a rule that keeps every key, or a window, needs none)."""

    full_keys: int
    full_values: int
    quant_keys: int = 0
    quant_values: int = 0
    key_groups: int = 0
    bits: int = 16
    group: int = 32
    compensation: int = 0
    positions: int = 0


def key_boundary(rule, tokens: int) -> int:
    """KIVI's keys: positions below this are quantized (per channel, ``group`` tokens per scale), the rest wait in
    the full-precision residual, which is quantized all at once when it reaches ``residual`` tokens (``residual=0``:
    each group as soon as it is whole, so fewer than ``group`` keys wait). Counted from the rule's first non-sink
    position (0 for full heads)."""
    start = rule.sinks
    if rule.bits == 16 or tokens <= start:
        return min(tokens, start)
    unit = rule.residual or rule.group
    return start + (tokens - start) // unit * unit


def value_boundary(rule, tokens: int) -> int:
    """KIVI's values: positions below this are quantized (per token, ``group`` channels per scale); the last
    ``residual`` tokens stay in full precision (``residual=0``: none, every value is quantized as it enters)."""
    start = rule.sinks
    if rule.bits == 16 or tokens <= start:
        return min(tokens, start)
    return max(start, tokens - rule.residual)


def held_layout(rule, n: int, *, start: int, low: int) -> Layout:
    """Held: positions ``[0, min(start, n))`` (sinks, full precision) and ``[low, n)``; quantized as KIVI below the
    key and value boundaries."""
    sinks = min(start, n)
    held = max(0, n - low)
    if rule.bits == 16:
        return Layout(sinks + held, sinks + held)
    bk, bv = key_boundary(rule, n), value_boundary(rule, n)
    qk, qv = max(0, bk - low), max(0, bv - low)
    groups = (bk - start) // rule.group - (low - start) // rule.group if qk else 0
    return Layout(sinks + held - qk, sinks + held - qv, qk, qv, groups, rule.bits, rule.group)
