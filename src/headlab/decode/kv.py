"""KV-cache policies per kv head: which keys each head keeps while a model decodes.

A **rule** says what one kv head of one layer holds:

- :data:`full` keeps every key (the ordinary cache);
- :func:`window(sink, recent) <window>` keeps the first ``sink`` keys and the last ``recent`` ones
  (StreamingLLM's attention sinks plus a sliding window, Xiao et al. 2024);
- :data:`drop` keeps nothing: the kv head is pruned, with the query heads that read it (their
  output is zero, as if their W^O columns were removed);
- :func:`snap(budget, window, pool) <snap>` keeps, after the prefill, the ``budget`` prompt tokens its
  observation window (the last ``window`` prompt queries) attends to most, then every new token (SnapKV,
  Li et al. 2024); :func:`adakv` lets the heads of a layer share one budget, allocated by their scores
  jointly with a floor per head (Ada-KV, Feng et al. 2024). What they keep depends on the prompt.

Full and windowed rules also carry a precision, ``bits`` 16 (the cache's dtype), 8, 4 or 2: keys per
channel and values per token in asymmetric min-max groups, the most recent tokens in full precision
(Liu et al. 2024, KIVI): ``kv.full(bits=4)``, ``kv.window(4, 256, bits=2)``. A window may also keep
RazorAttention's compensation token (Tang et al. 2024), the mean of the keys and values it evicted:
``kv.window(4, 256, compensate=True)``. What a rule holds after ``n`` tokens is :meth:`Full.layout`
(:class:`Layout`), from which :mod:`headlab.costs.kv` counts the bytes.

A :class:`Policy` maps ``(layer, kv_head)`` to a rule. Keys keep their original positions (rotary
embeddings are applied before caching), so decoding under a policy is *one forward* in which key
``j`` is visible to query ``t`` when ``j <= t`` and ``(j < sink or t - j < recent)`` for windowed heads,
``j <= t`` for full heads, and nothing for dropped heads (:meth:`Policy.visible`). Grouped-query
models share one kv head among several query heads: a kv head is kept full when any of its query
heads needs the whole context (the constructors that rank heads take the maximum over the group).

    >>> from headlab import kv
    >>> p = kv.Policy.from_spec({(0, 1): kv.window(sink=1, recent=2), (1, 0): kv.drop}, default="full")
    >>> p.rule(0, 1), p.rule(1, 0), p.rule(1, 1)
    (window(sink=1, recent=2), drop, full)
    >>> p.visible(0, 1, 5).int()            # query t sees keys j <= t with j < 1 or t - j < 2
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 0, 1, 1, 0],
            [1, 0, 0, 1, 1]], dtype=torch.int32)
    >>> p.kept(1000, [2, 2])                 # keys held per (layer, kv head) after 1000 tokens
    [[1000, 3], [0, 1000]]
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from headlab.errors import ConfigError, InputError, ModelError

__all__ = ["Full", "Window", "Drop", "Snap", "Rule", "Layout", "full", "drop", "window", "snap", "adakv", "Policy",
           "kv_layout"]


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


Rule = Full | Window | Drop  # and Snap (defined below)
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


POOLINGS = ("max", "avg")


@dataclass(frozen=True)
class Snap(_Rule):
    """SnapKV (Li et al. 2024): after the prefill, keep the prompt tokens that the last ``window`` prompt queries
    attend to most, and the window itself; every token after the prefill is kept. With ``adaptive``, Ada-KV's
    allocation (Feng et al. 2024): the kv heads of a layer that follow this rule share one budget, picked as the
    highest scores over all of them jointly, each head keeping at least ``floor``.

    The score of prompt key ``j < n - window`` for a query head is the attention the window's queries give it
    (``sum_i softmax(q_i k / sqrt d)_j``, each row over all the keys it sees), smoothed along the positions by a
    1-D ``pooling`` ("max" or "avg") of width ``pool`` (padded, stride 1); a kv head's score is the *mean* over
    its query heads (grouped-query models, as kvpress does). Ties go to the earlier position (Ada-KV: the lower
    kv head first). Build one with :func:`snap` or :func:`adakv`."""

    budget: int | None           # prompt tokens a head keeps, window included (Ada-KV: on average)
    window: int = 32             # the observation window: the last prompt queries, whose keys are kept
    pool: int = 7                # width of the 1-D pooling of the scores (odd; 1: none)
    pooling: str = "max"
    adaptive: bool = False       # Ada-KV: the heads of a layer under this rule share their budgets
    total: int | None = None     # Ada-KV: the prompt tokens those heads keep together (else budget x heads)
    floor: int | None = None     # Ada-KV: the fewest prompt tokens a head keeps, window included

    kind = "snap"
    special = False

    def group_total(self, heads: int) -> int:
        """The prompt tokens ``heads`` kv heads under this rule keep together (prompts longer than that)."""
        return self.total if self.total is not None else self.budget * heads

    def floor_for(self, heads: int) -> int:
        """Ada-KV's floor for a layer of ``heads`` heads under this rule: ``floor``, or by default the window plus
        a fifth of the average share past it (Ada-KV's safeguard, alpha = 0.2)."""
        if self.floor is not None:
            return self.floor
        avg = self.group_total(heads) // heads
        return self.window + max(0, avg - self.window) // 5

    def check_heads(self, heads: int, layer: int) -> None:
        if not self.adaptive or heads == 0:
            return
        total, floor = self.group_total(heads), self.floor_for(heads)
        if total < heads * max(floor, self.window):
            raise ConfigError(f"layer {layer}: {heads} kv heads share total={total} prompt tokens under Ada-KV, but "
                              f"each keeps at least floor={max(floor, self.window)} (its observation window "
                              f"included): {heads} x {max(floor, self.window)} > {total}; raise the total or lower "
                              "the floor")

    def layouts(self, heads: int, tokens: int, prompt: int | None = None) -> list[Layout]:
        """The prompt's kept tokens (``min(prompt, budget)`` per head; Ada-KV: ``min(total, heads x prompt)`` split
        evenly, the real split being the data's) plus every token after it."""
        p = tokens if prompt is None else prompt
        if not 0 <= p <= tokens:
            raise ConfigError(f"prompt={p} and tokens={tokens}: give 0 <= prompt <= tokens")
        after = tokens - p
        if not self.adaptive:
            n = min(p, self.budget) + after
            return [Layout(n, n)] * heads
        q, r = divmod(min(self.group_total(heads), heads * p), heads) if heads else (0, 0)
        return [Layout(q + (i < r) + after, q + (i < r) + after) for i in range(heads)]

    def layout(self, tokens: int, prompt: int | None = None) -> Layout:
        if self.adaptive and self.total is not None:
            raise ConfigError("an Ada-KV rule with a total shares it among the heads of a layer: ask "
                              "Policy.layouts (or rule.layouts(heads, ...)) for what each head holds")
        return self.layouts(1, tokens, prompt)[0]

    def kept(self, tokens: int, prompt: int | None = None) -> int:
        return self.layout(tokens, prompt).full_keys

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        raise ConfigError(f"{self!r} keeps the prompt tokens its observation window attends to: which ones depends on "
                          "the prompt, not on positions alone; HeadCache.positions(layer, kv_head) gives them after "
                          "the prefill")

    def text(self) -> str:
        """What :func:`as_rule` reads back: ``snapkv:256,window=32,pool=7``, ``adakv:total=768,floor=64,...``."""
        opts = [f"window={self.window}", f"pool={self.pool}"] + (["pooling=avg"] if self.pooling != "max" else [])
        if not self.adaptive:
            return ",".join([f"snapkv:{self.budget}"] + opts)
        size = f"total={self.total}" if self.total is not None else str(self.budget)
        return ",".join([f"adakv:{size}"] + ([f"floor={self.floor}"] if self.floor is not None else []) + opts)

    def label(self) -> str:
        """What tables call a uniform policy of it: ``SnapKV 256``, ``Ada-KV 256/head``, ``Ada-KV 768/layer``."""
        if not self.adaptive:
            return f"SnapKV {self.budget}"
        return f"Ada-KV {self.budget}/head" if self.total is None else f"Ada-KV {self.total}/layer"

    def __repr__(self) -> str:
        opts = f"window={self.window}, pool={self.pool}" + (", pooling='avg'" if self.pooling != "max" else "")
        if not self.adaptive:
            return f"snap({self.budget}, {opts})"
        size = f"total={self.total}" if self.total is not None else f"{self.budget}"
        floor = f", floor={self.floor}" if self.floor is not None else ""
        return f"adakv({size}{floor}, {opts})"


def _check_snap(window, pool, pooling) -> None:
    _check_int("window", window, low=1)
    _check_int("pool", pool, low=1)
    if pool % 2 == 0:
        raise ConfigError(f"pool={pool}: SnapKV pools the scores over an odd number of positions (centred on each "
                          "key), e.g. pool=7; pool=1 pools nothing")
    if pooling not in POOLINGS:
        raise ConfigError(f"pooling={pooling!r}: use 'max' (SnapKV's) or 'avg' (kvpress's)")


def snap(budget: int, window: int = 32, pool: int = 7, *, pooling: str = "max") -> Snap:
    """SnapKV's rule for a kv head: after the prefill it keeps ``budget`` prompt tokens, the last ``window`` (the
    observation window) and the ``budget - window`` earlier ones the window attends to most, then every new token.

    A prompt of at most ``budget`` tokens is kept whole. The prompt must be at least ``window`` tokens
    (:class:`~headlab.errors.InputError` at the prefill). Raises :class:`~headlab.errors.ConfigError` for a
    budget or window below 1, a budget below the window, an even pool, or a pooling other than "max", "avg".
    """
    _check_int("budget", budget, low=1)
    _check_snap(window, pool, pooling)
    if budget < window:
        raise ConfigError(f"snap(budget={budget}, window={window}): the budget counts the observation window it "
                          f"always keeps; give budget >= window (e.g. snap({max(budget, 4 * window)}, window={window}))")
    return Snap(budget, window, pool, pooling)


def adakv(budget: int | None = None, *, total: int | None = None, floor: int | None = None, window: int = 32,
          pool: int = 7, pooling: str = "max") -> Snap:
    """Ada-KV's rule (Feng et al. 2024) on SnapKV's scores: the kv heads of a layer that follow it keep ``total``
    prompt tokens together (or ``budget`` per head on average: ``budget x heads``), the highest scores over all
    of them jointly, each head at least ``floor`` (its window included; default: the window plus a fifth of the
    average share past it, Ada-KV's alpha = 0.2). A head whose window attends to a few tokens gives its share to
    heads that spread their attention.

    Raises :class:`~headlab.errors.ConfigError` unless exactly one of ``budget``, ``total`` is given, for a
    floor below the window or above the budget, and (when the policy meets the model) for ``floor x heads >
    total``.
    """
    if (budget is None) == (total is None):
        raise ConfigError("adakv takes budget= (prompt tokens per kv head, on average) or total= (per layer), "
                          "exactly one of them, e.g. adakv(256) or adakv(total=768)")
    _check_snap(window, pool, pooling)
    size = budget if budget is not None else total
    _check_int("budget" if budget is not None else "total", size, low=1)
    if budget is not None and budget < window:
        raise ConfigError(f"adakv(budget={budget}, window={window}): the budget counts the observation window every "
                          "head keeps; give budget >= window")
    if floor is not None:
        _check_int("floor", floor, low=1)
        if floor < window:
            raise ConfigError(f"floor={floor} < window={window}: every head keeps its observation window, so its "
                              f"floor is at least the window (floor counts it)")
        if floor > size:
            raise ConfigError(f"floor={floor} is more than the {'budget' if budget is not None else 'total'} "
                              f"{size}: each head would keep more than the heads share")
    return Snap(budget, window, pool, pooling, True, total, floor)


Rule = Full | Window | Drop | Snap


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _options(x, name: str, items: list[str]) -> dict:
    """``key=value`` items of a rule's text (``compensate`` alone means ``compensate=true``)."""
    opts: dict = {}
    for item in items:
        key, eq, val = (p.strip() for p in item.partition("="))
        if key == "compensate" and name != "full":
            if not eq or val in _TRUE:
                opts["compensate"] = True
            elif val in _FALSE:
                opts["compensate"] = False
            else:
                raise ConfigError(f"kv rule {x!r}: compensate takes true or false, got {val!r}")
            continue
        if key not in ("bits", "group", "residual") or not eq:
            allowed = "bits=, group=, residual=" + (", compensate" if name != "full" else "")
            raise ConfigError(f"kv rule {x!r}: unknown option {item.strip()!r}; {name} takes {allowed} "
                              f"(e.g. {name}:{'4,256,' if name != 'full' else ''}bits=4)")
        try:
            opts[key] = int(val)
        except ValueError:
            raise ConfigError(f"kv rule {x!r}: {key} takes an integer, got {val!r}") from None
    return opts


def as_rule(x) -> Rule:
    """A rule from a rule or its text: ``"full"``, ``"drop"``, ``"window:SINK,RECENT"`` / ``"streaming:SINK,RECENT"``,
    each (but drop) with options: ``"full:bits=4"``, ``"streaming:4,256,bits=2,group=32,residual=128"``,
    ``"window:4,256,compensate"``; SnapKV ``"snapkv:256"`` (``"snapkv:256,window=32,pool=7,pooling=avg"``) and
    Ada-KV ``"adakv:256"`` (256 per kv head on average) or ``"adakv:total=768,floor=64"``."""
    if isinstance(x, _Rule):
        return x
    if not isinstance(x, str):
        raise ConfigError(f"a kv rule is kv.full, kv.drop, kv.window(sink, recent), kv.snap(budget), kv.adakv(budget) "
                          f"or its text; got {x!r}")
    text = x.strip().lower()
    if text == "full":
        return full
    if text == "drop":
        return drop
    name, _, args = text.partition(":")
    parts = [p.strip() for p in args.split(",")] if args else []
    if name == "full" and parts:
        opts = _options(x, "full", parts)
        return full(opts.pop("bits", 16), **opts)
    if name in ("window", "streaming"):
        nums_text = [p for p in parts if "=" not in p and p != "compensate"]
        try:
            nums = [int(p) for p in nums_text]
        except ValueError:
            nums = []
        if len(nums) != 2 or parts[:2] != nums_text:
            raise ConfigError(f"kv rule {x!r}: write {name}:SINK,RECENT with two integers, then any options, e.g. "
                              f"{name}:4,256 or {name}:4,256,bits=4,compensate")
        return window(*nums, **_options(x, name, parts[2:]))
    if name in ("snapkv", "snap", "adakv"):
        return _snap_rule(x, name, parts)
    raise ConfigError(f"unknown kv rule {x!r}: use full, drop, streaming:SINK,RECENT (e.g. streaming:4,256), "
                      "snapkv:BUDGET or adakv:BUDGET, with options such as full:bits=4, streaming:4,256,bits=2,compensate "
                      "or snapkv:256,window=32,pool=7")


def _snap_rule(x: str, name: str, parts: list[str]) -> Snap:
    """``snapkv:BUDGET[,window=W,pool=P,pooling=max|avg]``, ``adakv:BUDGET`` or ``adakv:total=T`` (and ``floor=F``)."""
    allowed = ("window", "pool", "pooling") + (("total", "floor") if name == "adakv" else ())
    example = f"{name}:256,window=32,pool=7" + (" or adakv:total=768,floor=64" if name == "adakv" else "")
    opts: dict = {}
    budget = None
    for i, item in enumerate(parts):
        key, eq, val = (p.strip() for p in item.partition("="))
        if not eq and i == 0:
            key, val = "budget", key
        elif key not in allowed or not eq:
            raise ConfigError(f"kv rule {x!r}: unknown option {item!r}; {name} takes {', '.join(a + '=' for a in allowed)}"
                              f" (e.g. {example})")
        if key == "pooling":
            opts[key] = val
            continue
        try:
            num = int(val)
        except ValueError:
            raise ConfigError(f"kv rule {x!r}: {key} takes an integer, got {val!r} (e.g. {example})") from None
        if key == "budget":
            budget = num
        else:
            opts[key] = num
    if name == "adakv":
        return adakv(budget, **opts)
    if budget is None:
        raise ConfigError(f"kv rule {x!r}: write {name}:BUDGET, the prompt tokens each kv head keeps (e.g. {example})")
    return snap(budget, **opts)


def kv_layout(model) -> tuple[list[int], list[int]]:
    """``(query heads per layer, kv heads per layer)`` of a model, LoadedModel or adapter, or of a
    ``(heads, kv_heads)`` pair of lists given directly."""
    if isinstance(model, tuple) and len(model) == 2:
        return list(model[0]), list(model[1])
    from headlab.models.loaded_model import resolve

    adapter, _ = resolve(model)
    return list(adapter.layer_heads), list(adapter.layer_kv_heads)


@dataclass(frozen=True)
class Policy:
    """A rule per ``(layer, kv_head)``; heads not named follow ``default``.

    Build one with :meth:`uniform`, :meth:`from_spec`, :meth:`from_scores` (and its named forms
    :meth:`from_importance`, :meth:`from_atlas`), :meth:`random`, :meth:`parse` or :meth:`load`.
    """

    rules: Mapping[tuple[int, int], Rule]
    default: Rule = full
    name: str = "policy"  # what tables and plots call it

    # -- constructors --------------------------------------------------------------------------------------
    @classmethod
    def uniform(cls, rule, *, name: str | None = None) -> Policy:
        """Every kv head follows ``rule``: ``Policy.uniform(kv.window(4, 256))`` is StreamingLLM."""
        r = as_rule(rule)
        return cls({}, r, name or r.label())

    @classmethod
    def snapkv(cls, budget: int, *, window: int = 32, pool: int = 7, pooling: str = "max") -> Policy:
        """SnapKV on every kv head: ``Policy.uniform(kv.snap(budget, window, pool))``."""
        return cls.uniform(snap(budget, window, pool, pooling=pooling))

    @classmethod
    def adakv(cls, budget: int | None = None, *, total_per_layer: int | None = None, floor: int | None = None,
              window: int = 32, pool: int = 7, pooling: str = "max") -> Policy:
        """Ada-KV on SnapKV's scores for every layer: its kv heads keep ``total_per_layer`` prompt tokens together (or
        ``budget`` per head on average), allocated by their scores jointly, each at least ``floor`` (:func:`adakv`)."""
        return cls.uniform(adakv(budget, total=total_per_layer, floor=floor, window=window, pool=pool, pooling=pooling))

    @classmethod
    def from_spec(cls, spec: Mapping, default="full", *, name: str = "spec") -> Policy:
        """``{(layer, kv_head): rule}`` (keys may also be ``"layer.kv_head"`` text); the rest ``default``."""
        rules = {}
        for key, rule in spec.items():
            if isinstance(key, str):
                try:
                    key = tuple(int(p) for p in key.split("."))
                except ValueError:
                    key = ()
            if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(i, int) for i in key)):
                raise ConfigError(f"policy key {key!r}: use (layer, kv_head) pairs of integers, or 'layer.kv_head'")
            rules[key] = as_rule(rule)
        return cls(rules, as_rule(default), name)

    @classmethod
    def from_scores(cls, model, scores, *, keep: float, rest=None, name: str = "scores", kept=None) -> Policy:
        """Keep the ``keep`` fraction of kv heads with the highest ``scores`` full; the others follow ``rest``.

        Args:
            model: a model, LoadedModel or adapter (for its heads and kv heads per layer).
            scores: ``(layers, heads)`` per *query* head (higher = needs the whole context). A kv head
                takes the maximum over its query heads (kept full when any of them needs it).
            keep: fraction of kv heads kept full, in ``[0, 1]`` (rounded to whole heads).
            rest: the rule for the others (default ``window(4, 256)``).
            kept: the rule for the heads kept (default :data:`full`; ``kv.full(bits=4)`` puts the split on
                4-bit KV, as DuoAttention does).
        """
        heads, kvh = kv_layout(model)
        try:
            s = torch.as_tensor(scores, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ConfigError(f"scores must be a (layers, heads) array of numbers: {e}") from None
        if s.dim() != 2 or s.shape[0] != len(heads) or s.shape[1] != max(heads):
            raise ConfigError(f"scores of shape {tuple(s.shape)} do not fit this model: expected (layers, heads) = "
                              f"({len(heads)}, {max(heads)})")
        for layer, h in enumerate(heads):  # a pruned layer's columns past its heads are not read
            bad = s[layer, :h].isnan().nonzero()
            if bad.numel():
                raise ConfigError(f"scores hold NaN (layer {layer}, head {int(bad[0, 0])}, ...): a NaN cannot be "
                                  "ranked; compute the scores again or replace the NaN with a number")
        if isinstance(keep, bool) or not isinstance(keep, int | float) or not 0.0 <= keep <= 1.0:
            raise ConfigError(f"keep={keep!r} is the fraction of kv heads kept full: give a number in [0, 1]")
        per_kv = []
        for layer, (h, g) in enumerate(zip(heads, kvh)):
            rep = h // g
            for j in range(g):
                per_kv.append((float(s[layer, j * rep:(j + 1) * rep].max()), layer, j))
        n_full = round(keep * len(per_kv))
        ranked = sorted(per_kv, key=lambda t: (-t[0], t[1], t[2]))
        chosen = {(l, j) for _, l, j in ranked[:n_full]}
        r = as_rule(rest) if rest is not None else window(4, 256)
        top = as_rule(kept) if kept is not None else full
        return cls({(l, j): (top if (l, j) in chosen else r) for _, l, j in per_kv}, r, name)

    @classmethod
    def from_importance(cls, model, importance, *, keep: float, rest=None, kept=None) -> Policy:
        """The most important heads full (Michel et al. 2019's scores, ``headlab.head_importance``), the rest ``rest``.

        ``importance``: an :class:`~headlab.interpret.heads.importance.ImportanceResult` or a ``(layers, heads)`` tensor.
        """
        scores = getattr(importance, "scores", importance)
        return cls.from_scores(model, scores, keep=keep, rest=rest, name=f"importance {keep:.0%} full", kept=kept)

    @classmethod
    def from_atlas(cls, model, atlas, *, keep: float, rest=None, kept=None) -> Policy:
        """DuoAttention's split: retrieval and non-streaming heads full, the streaming heads windowed.

        ``atlas`` is an object with ``.scores`` (``headlab.atlas``), a dict of ``(layers, heads)`` scores,
        or the path of an atlas JSON (``{"scores": {kind: [[...]]}}``). A head's need for the whole
        context is ``1 - min(1, sink + local)`` (the attention mass a window would lose), plus its
        ``retrieval`` score when the atlas has one (Wu et al. 2024); the ``keep`` fraction with the
        highest need stays full.
        """
        scores = _atlas_scores(atlas)
        missing = {"sink", "local"} - set(scores)
        if missing:
            raise ConfigError(f"the atlas has no {sorted(missing)} scores (it has {sorted(scores)}); build it with "
                              "kinds including 'sink' and 'local'")
        need = 1.0 - (scores["sink"] + scores["local"]).clamp(max=1.0)
        if "retrieval" in scores:
            need = need + scores["retrieval"]
        return cls.from_scores(model, need, keep=keep, rest=rest, name=f"atlas split {keep:.0%} full", kept=kept)

    @classmethod
    def random(cls, model, *, keep: float, rest=None, seed: int = 0, kept=None) -> Policy:
        """The control: a random ``keep`` fraction of kv heads full (seeded), the rest ``rest``."""
        heads, _ = kv_layout(model)
        g = torch.Generator().manual_seed(seed)
        scores = torch.rand(len(heads), max(heads), generator=g, dtype=torch.float64)
        return cls.from_scores(model, scores, keep=keep, rest=rest, name=f"random {keep:.0%} full (seed {seed})",
                               kept=kept)

    @classmethod
    def parse(cls, text: str) -> Policy:
        """A uniform policy from its text: ``full``, ``drop``, ``streaming:4,256`` (or ``window:4,256``), with options
        ``full:bits=4``, ``streaming:4,256,bits=2,group=32,residual=128``, ``streaming:4,256,compensate``; SnapKV
        ``snapkv:256`` (``snapkv:256,window=32,pool=7``), Ada-KV ``adakv:256`` or ``adakv:total=768,floor=64``."""
        return cls.uniform(as_rule(text))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Policy:
        """A policy saved with :meth:`to_json` (``{"default": ..., "heads": {"layer.kv_head": rule}}``)."""
        p = Path(path).expanduser()
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InputError(f"policy file {str(p)!r} does not exist") from None
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"policy file {str(p)!r} is not readable JSON: {e}") from None
        if not isinstance(data, dict) or "heads" not in data:
            raise InputError(f"policy file {str(p)!r}: expected {{\"default\": ..., \"heads\": {{\"layer.kv_head\": rule}}}}")
        return cls.from_spec(data["heads"], data.get("default", "full"), name=data.get("name", p.stem))

    def to_json(self) -> dict:
        return {"name": self.name, "default": self.default.text(),
                "heads": {f"{l}.{h}": r.text() for (l, h), r in sorted(self.rules.items())}}

    # -- reading -------------------------------------------------------------------------------------------
    def rule(self, layer: int, kv_head: int) -> Rule:
        return self.rules.get((layer, kv_head), self.default)

    def check(self, kv_heads: Sequence[int], *, model: str = "the model") -> None:
        """Refuse rules for a layer or kv head the model lacks (``kv_heads``: kv heads per layer)."""
        for (layer, head) in self.rules:
            if not 0 <= layer < len(kv_heads):
                raise ConfigError(f"the policy names layer {layer}, but {model} has layers 0..{len(kv_heads) - 1}")
            if not 0 <= head < kv_heads[layer]:
                raise ConfigError(f"the policy names kv head {head} of layer {layer}, but that layer has kv heads "
                                  f"0..{kv_heads[layer] - 1} (grouped-query models have fewer kv heads than query heads)")
        for layer, g in enumerate(kv_heads):
            for rule, heads in self.layer_groups(layer, g).items():
                rule.check_heads(len(heads), layer)

    def layer_groups(self, layer: int, n_kv: int) -> dict[Rule, list[int]]:
        """The layer's kv heads by rule, ``{rule: [kv heads]}`` in order (a cache group per rule)."""
        out: dict[Rule, list[int]] = {}
        for j, r in enumerate(self.layer_rules(layer, n_kv)):
            out.setdefault(r, []).append(j)
        return out

    def layer_rules(self, layer: int, n_kv: int) -> list[Rule]:
        return [self.rule(layer, h) for h in range(n_kv)]

    def kept(self, tokens: int, kv_heads: Sequence[int], prompt: int | None = None) -> list[list[int]]:
        """Keys held per ``[layer][kv_head]`` once ``tokens`` tokens have been cached, the first ``prompt`` of them
        (None: all) as the prefill (SnapKV selects from the prefill; an Ada-KV layer's count is split evenly here)."""
        return [[lay.full_keys + lay.quant_keys + lay.compensation for lay in layer]
                for layer in self.layouts(tokens, kv_heads, prompt)]

    def visible(self, layer: int, kv_head: int, q_len: int, kv_len: int | None = None) -> torch.Tensor:
        """``(q_len, kv_len)`` bool: may query ``t`` see key ``j`` under this head's rule (positions from 0).
        SnapKV's rules refuse (what they keep depends on the prompt)."""
        return visibility(self.rule(layer, kv_head), torch.arange(q_len)[:, None], torch.arange(kv_len or q_len)[None])

    def counts(self, kv_heads: Sequence[int]) -> dict[str, int]:
        """How many kv heads are full, windowed and dropped (and ``snap``: SnapKV / Ada-KV, when there are any)."""
        out = {"full": 0, "window": 0, "drop": 0}
        for l, g in enumerate(kv_heads):
            for r in self.layer_rules(l, g):
                out[r.kind] = out.get(r.kind, 0) + 1
        return out

    def bits(self, kv_heads: Sequence[int]) -> dict[int, int]:
        """How many kv heads (dropped ones aside) store 16, 8, 4 and 2 bits."""
        out = dict.fromkeys(BITS, 0)
        for l, g in enumerate(kv_heads):
            for r in self.layer_rules(l, g):
                if not isinstance(r, Drop):
                    out[r.bits] += 1
        return out

    def layouts(self, tokens: int, kv_heads: Sequence[int], prompt: int | None = None) -> list[list[Layout]]:
        """What each ``[layer][kv_head]`` holds once ``tokens`` tokens have been cached (:class:`Layout`), the
        first ``prompt`` (None: all) as the prefill. Each rule answers for its heads of a layer together."""
        self.check(kv_heads)
        out = []
        for l, g in enumerate(kv_heads):
            row: list[Layout | None] = [None] * g
            for rule, heads in self.layer_groups(l, g).items():
                for j, lay in zip(heads, rule.layouts(len(heads), tokens, prompt)):
                    row[j] = lay
            out.append(row)
        return out

    def check_shape(self, kv_heads: Sequence[int], head_dim: int, v_dim: int | None = None) -> None:
        """Refuse quantized rules whose groups or packing do not fit ``head_dim`` (and ``v_dim``)."""
        v_dim = head_dim if v_dim is None else v_dim
        for l, g in enumerate(kv_heads):
            for j, r in enumerate(self.layer_rules(l, g)):
                if r.bits == 16:
                    continue
                if v_dim % r.group:
                    raise ConfigError(f"kv head {j} of layer {l}: group={r.group} does not divide the head dimension "
                                      f"{v_dim} (values are quantized per token in groups of channels); give a group "
                                      f"that divides it, e.g. group={math.gcd(v_dim, r.group)}")
                for what, d in (("head", head_dim), ("value", v_dim)):
                    if d * r.bits % 8:
                        raise ConfigError(f"kv head {j} of layer {l}: a {what} dimension of {d} at {r.bits} bits "
                                          "does not fill whole bytes; quantize it at 8 bits")


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


def _atlas_scores(atlas) -> dict[str, torch.Tensor]:
    if isinstance(atlas, str | os.PathLike):
        p = Path(atlas).expanduser()
        try:
            atlas = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"atlas file {str(p)!r} cannot be read as JSON: {e}") from None
    raw = getattr(atlas, "scores", None)
    if raw is None and isinstance(atlas, Mapping):
        raw = atlas.get("scores", atlas)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"from_atlas takes an atlas (with .scores), a dict of scores or an atlas JSON path; got "
                          f"{type(atlas).__name__}")
    out = {}
    for k, v in raw.items():
        try:
            t = torch.as_tensor(v, dtype=torch.float64)
        except (TypeError, ValueError):
            continue
        if t.dim() == 2:
            out[k] = t.nan_to_num(0.0)
    return out


def check_decoder(adapter, name: str = "the model") -> None:
    """Refuse a model that cannot decode (an encoder-only model has no causal attention nor LM head)."""
    if not adapter.causal:
        raise ModelError(f"{name} is an encoder-only model (bidirectional attention, no next-token head): a KV cache "
                         "and decoding need a causal language model such as smollm2")
