"""The per-head KV rules that depend on positions alone, and what they hold: :class:`Layout`, :data:`full`,
:data:`drop`, :func:`window` (their classes :class:`Full`, :class:`Drop`, :class:`Window`), KIVI's precision
(``bits``, ``group``, ``residual``) and boundaries, and :func:`visibility`.

Public through :mod:`headlab.kv` (``headlab.decode.kv``), which re-exports all of it; SnapKV's and Ada-KV's rule
is in :mod:`headlab.decode.snap_rule`, policies and the parsing of rule texts in :mod:`headlab.decode.kv`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headlab.errors import ConfigError

__all__ = ["BITS", "GROUP", "RESIDUAL", "Layout", "Full", "Drop", "Window", "Rule", "full", "drop", "window",
           "key_boundary", "value_boundary", "visibility"]


BITS = (16, 8, 4, 2)   # 16: the cache's own dtype; 8, 4, 2: quantized (KIVI)
GROUP = 32             # numbers per scale: tokens per key group (per channel), channels per value group (per token)
RESIDUAL = 128         # the most recent tokens kept in full precision (a multiple of the group)


@dataclass(frozen=True)
class Layout:
    """What one kv head holds after ``tokens`` tokens, counted (one batch row): the single place that decides
    what a rule holds; :func:`headlab.costs.kv.layout_bytes` turns it into bytes, and the cache's tensors
    must come to the same (a test checks them).

    ``full_keys``/``full_values``: vectors in the cache's dtype (sinks, the full-precision residual);
    ``quant_keys``/``quant_values``: vectors stored as ``bits``-bit codes, packed ``8 // bits`` to a byte;
    ``key_groups``: ``(scale, zero)`` pairs per key channel (one per ``group`` quantized tokens); each
    quantized value has ``v_dim / group`` pairs; ``compensation``: 0 or 1 extra key/value pair in the
    cache's dtype (RazorAttention's mean of the evicted tokens)."""

    full_keys: int
    full_values: int
    quant_keys: int = 0
    quant_values: int = 0
    key_groups: int = 0
    bits: int = 16
    group: int = 32
    compensation: int = 0


class _Rule:
    """What every kind of rule answers; the policy, the cache and the cost model ask the rule, not its type.

    ``kind``: what :meth:`Policy.counts` calls it; ``layouts(heads, tokens, prompt)``: what each of the ``heads``
    kv heads of one layer that follow the rule holds (a rule whose heads share a budget, Ada-KV's, splits it
    there); ``check_heads``: refuse a layer the rule cannot serve; ``visible``: its visibility by positions."""

    kind = "rule"
    bits = 16

    def layout(self, tokens: int, prompt: int | None = None) -> Layout:  # pragma: no cover - every kind has one
        raise NotImplementedError

    def layouts(self, heads: int, tokens: int, prompt: int | None = None) -> list[Layout]:
        """What each of ``heads`` kv heads of a layer that follow this rule holds after ``tokens`` tokens, of which
        the first ``prompt`` came as the prefill (None: all of them)."""
        return [self.layout(tokens, prompt)] * heads

    def check_heads(self, heads: int, layer: int) -> None:
        """Refuse to serve ``heads`` kv heads of ``layer`` (nothing to refuse for a per-head rule)."""

    def text(self) -> str:
        return _rule_text(self)

    def label(self) -> str:
        return _rule_name(self)


def _check_int(name: str, val, *, low: int) -> None:
    if isinstance(val, bool) or not isinstance(val, int):
        raise ConfigError(f"{name} must be an integer, got {val!r}")
    if val < low:
        raise ConfigError(f"{name}={val} must be at least {low}")


def _check_precision(bits, group, residual) -> tuple[int, int, int]:
    """``(bits, group, residual)`` checked; ``group``/``residual`` None take the defaults."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ConfigError(f"bits={bits!r}: a kv head stores keys and values at 16 (the cache's dtype), 8, 4 or 2 "
                          "bits (KIVI's asymmetric min-max groups)")
    if bits == 16:
        if group is not None or residual is not None:
            raise ConfigError("group and residual set how a quantized head stores its keys; give them with bits=8, 4 "
                              "or 2 (bits=16 stores every key as it is)")
        return 16, GROUP, RESIDUAL
    group = GROUP if group is None else group
    residual = RESIDUAL if residual is None else residual
    _check_int("group", group, low=1)
    _check_int("residual", residual, low=1)
    if residual % group:
        raise ConfigError(f"residual={residual} must be a multiple of group={group}: the keys leave the full-precision "
                          "residual a group of tokens at a time (KIVI), e.g. group=32, residual=128")
    return bits, group, residual


def _precision_text(r) -> str:
    if r.bits == 16:
        return ""
    extra = "" if (r.group, r.residual) == (GROUP, RESIDUAL) else f", group={r.group}, residual={r.residual}"
    return f"bits={r.bits}{extra}"


@dataclass(frozen=True)
class Full(_Rule):
    """Keep every key (the ordinary cache), at ``bits`` bits (16: the cache's dtype; 8, 4, 2: quantized as KIVI).

    ``kv.full`` is the 16-bit rule; ``kv.full(bits=4)`` (a call of it) the same rule with 4-bit keys and values."""

    bits: int = 16
    group: int = GROUP       # quantized rules: tokens per key scale (per channel), channels per value scale
    residual: int = RESIDUAL  # quantized rules: the most recent tokens kept in full precision

    def __call__(self, bits: int = 16, *, group: int | None = None, residual: int | None = None) -> Full:
        """``kv.full(bits=4, group=32, residual=128)``: every key kept, quantized (Liu et al. 2024, KIVI)."""
        return Full(*_check_precision(bits, group, residual))

    @property
    def special(self) -> bool:
        """Quantized: the cache stores it apart from the plain (bit-exact) path."""
        return self.bits != 16

    kind = "full"

    def kept(self, tokens: int, prompt: int | None = None) -> int:
        return tokens

    def layout(self, tokens: int, prompt: int | None = None) -> Layout:
        return _layout(self, tokens, start=0, low=0)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return k_pos <= q_pos

    def __repr__(self) -> str:
        p = _precision_text(self)
        return f"full({p})" if p else "full"


@dataclass(frozen=True)
class Drop(_Rule):
    """Keep nothing: the kv head and its query heads are pruned (their output is zero)."""

    bits = 16  # nothing is stored; there for uniformity
    special = False
    kind = "drop"

    def kept(self, tokens: int, prompt: int | None = None) -> int:
        return 0

    def layout(self, tokens: int, prompt: int | None = None) -> Layout:
        return Layout(0, 0)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(k_pos <= q_pos)

    def __repr__(self) -> str:
        return "drop"


@dataclass(frozen=True)
class Window(_Rule):
    """Keep the first ``sink`` keys (attention sinks) and the last ``recent`` keys; with ``compensate``, one more
    key/value pair holding the mean of the evicted ones (RazorAttention)."""

    sink: int     # the first keys every query keeps seeing (StreamingLLM uses 4)
    recent: int   # how many of the latest keys, the query's own included, stay visible
    bits: int = 16
    group: int = GROUP
    residual: int = RESIDUAL
    compensate: bool = False

    kind = "window"

    def kept(self, tokens: int, prompt: int | None = None) -> int:
        return min(tokens, self.sink + self.recent) + self.compensation(tokens)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return (k_pos <= q_pos) & ((k_pos < self.sink) | (q_pos - k_pos < self.recent))

    def compensation(self, tokens: int) -> int:
        """1 when the rule holds a compensation token after ``tokens`` tokens (some key was evicted), else 0."""
        return int(self.compensate and tokens > self.sink + self.recent)

    def layout(self, tokens: int, prompt: int | None = None) -> Layout:
        lay = _layout(self, tokens, start=self.sink, low=max(self.sink, tokens - self.recent))
        comp = self.compensation(tokens)
        return Layout(lay.full_keys, lay.full_values, lay.quant_keys, lay.quant_values, lay.key_groups,
                      lay.bits, lay.group, comp)

    @property
    def special(self) -> bool:
        return self.bits != 16 or self.compensate

    def __repr__(self) -> str:
        p = _precision_text(self)
        extra = (f", {p}" if p else "") + (", compensate=True" if self.compensate else "")
        return f"window(sink={self.sink}, recent={self.recent}{extra})"


Rule = Full | Window | Drop  # and Snap (headlab.decode.snap_rule); kv.Rule is the union of all four
full = Full()
drop = Drop()


def key_boundary(rule, tokens: int) -> int:
    """KIVI's keys: positions below this are quantized (per channel, ``group`` tokens per scale), the rest wait in
    the full-precision residual, which is quantized all at once when it reaches ``residual`` tokens. Counted from
    the rule's first non-sink position (0 for full heads)."""
    start = rule.sink if isinstance(rule, Window) else 0
    if rule.bits == 16 or tokens <= start:
        return min(tokens, start)
    return start + (tokens - start) // rule.residual * rule.residual


def value_boundary(rule, tokens: int) -> int:
    """KIVI's values: positions below this are quantized (per token, ``group`` channels per scale); the last
    ``residual`` tokens stay in full precision."""
    start = rule.sink if isinstance(rule, Window) else 0
    if rule.bits == 16 or tokens <= start:
        return min(tokens, start)
    return max(start, tokens - rule.residual)


def _layout(rule, n: int, *, start: int, low: int) -> Layout:
    """Held: positions ``[0, min(start, n))`` (sinks, full precision) and ``[low, n)``; quantized as KIVI below the
    key and value boundaries."""
    sinks = min(start, n)
    held = max(0, n - low)
    if rule.bits == 16:
        return Layout(sinks + held, sinks + held)
    bk, bv = key_boundary(rule, n), value_boundary(rule, n)
    qk, qv = max(0, bk - low), max(0, bv - low)
    groups = 0
    if qk:
        groups = (bk - start) // rule.group - (low - start) // rule.group
    return Layout(sinks + held - qk, sinks + held - qv, qk, qv, groups, rule.bits, rule.group)


def window(sink: int = 4, recent: int = 256, *, bits: int = 16, group: int | None = None,
           residual: int | None = None, compensate: bool = False) -> Window:
    """The rule that keeps the first ``sink`` and the last ``recent`` keys of a kv head.

    ``bits`` (8, 4, 2) quantizes what it holds past the sinks as KIVI does (``group``, ``residual``: see
    :data:`full`); the sinks stay in full precision. ``compensate`` keeps one more key/value pair, the mean
    of the keys and values it evicted, weighted in the softmax by how many it stands for (Tang et al. 2024,
    RazorAttention).

    Raises :class:`~headlab.errors.ConfigError` for a negative count, or when both are 0 (a head
    that sees nothing: use :data:`drop` to prune it), or for bits other than 16, 8, 4, 2.
    """
    for name, val in (("sink", sink), ("recent", recent)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise ConfigError(f"window {name} must be an integer, got {val!r}")
        if val < 0:
            raise ConfigError(f"window {name}={val} is negative; give a count of keys >= 0, e.g. window(sink=4, recent=256)")
    if sink + recent == 0:
        raise ConfigError("window(sink=0, recent=0) keeps no key, so its heads would see nothing; keep at least one "
                          "key (e.g. window(sink=4, recent=256)), or use kv.drop to prune the head")
    if not isinstance(compensate, bool):
        raise ConfigError(f"compensate must be True or False, got {compensate!r}")
    return Window(sink, recent, *_check_precision(bits, group, residual), compensate)


def visibility(rule: Rule, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The rule's visibility for query positions ``q_pos`` and key positions ``k_pos`` (broadcast)."""
    return rule.visible(q_pos, k_pos)


def _rule_text(r: Rule) -> str:
    """The text :func:`as_rule` reads back (full, window, drop; other kinds answer ``text()`` themselves)."""
    if isinstance(r, Drop):
        return "drop"
    opts = [f"bits={r.bits}", f"group={r.group}", f"residual={r.residual}"] if r.bits != 16 else []
    if isinstance(r, Window):
        return ",".join([f"window:{r.sink}", str(r.recent)] + opts + (["compensate"] if r.compensate else []))
    return "full:" + ",".join(opts) if opts else "full"


def _rule_name(r: Rule) -> str:
    """What tables call a uniform policy: ``streaming 4+256``, ``streaming 4+256 4-bit compensated``, ``full 4-bit``."""
    if isinstance(r, Drop):
        return "drop"
    base = f"streaming {r.sink}+{r.recent}" if isinstance(r, Window) else "full"
    comp = " compensated" if getattr(r, "compensate", False) else ""
    return base + (f" {r.bits}-bit" if r.bits != 16 else "") + comp
