"""SnapKV's and Ada-KV's rule for a kv head (Li et al. 2024, Feng et al. 2024): :class:`Snap`, built with
:func:`snap` or :func:`adakv`. What such a head keeps depends on the prompt; the cache's group that holds it
is :class:`headlab.decode.snap_group.SnapStore` (its ``store``, ``"snap"``).

Public through :mod:`headlab.kv` (``headlab.decode.kv``), which re-exports all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from headlab.decode.layout import Layout, held_layout
from headlab.decode.rule_checks import GROUP, RESIDUAL, check_count, check_precision, check_stored
from headlab.decode.rules import Rule, precision_items, register_rule
from headlab.errors import ConfigError

__all__ = ["POOLINGS", "Snap", "snap", "adakv"]


POOLINGS = ("max", "avg")


@register_rule
@dataclass(frozen=True)
class Snap(Rule):
    """SnapKV (Li et al. 2024): after the prefill, keep the prompt tokens that the last ``window`` prompt queries
    attend to most, and the window itself; every token after the prefill is kept. With ``adaptive``, Ada-KV's
    allocation (Feng et al. 2024): the kv heads of a layer that follow this rule share one budget, picked as the
    highest scores over all of them jointly, each head keeping at least ``floor``.

    The score of prompt key ``j < n - window`` for a query head is the attention the window's queries give it
    (``sum_i softmax(q_i k / sqrt d)_j``, each row over all the keys it sees), smoothed along the positions by a
    1-D ``pooling`` ("max" or "avg") of width ``pool`` (padded, stride 1); a kv head's score is the *mean* over
    its query heads (grouped-query models, as kvpress does). Ties go to the earlier position (Ada-KV: the lower
    kv head first). Build one with :func:`snap` or :func:`adakv`."""

    budget: int | None  # prompt tokens a head keeps, window included (Ada-KV: on average)
    window: int = 32  # the observation window: the last prompt queries, whose keys are kept
    pool: int = 7  # width of the 1-D pooling of the scores (odd; 1: none)
    pooling: str = "max"
    adaptive: bool = False  # Ada-KV: the heads of a layer under this rule share their budgets
    total: int | None = None  # Ada-KV: the prompt tokens those heads keep together (else budget x heads)
    floor: int | None = None  # Ada-KV: the fewest prompt tokens a head keeps, window included
    bits: int = 16  # 8, 4, 2: what a head keeps is stored as KIVI's codes (the selection runs in full precision)
    group: int = GROUP
    residual: int = RESIDUAL

    kind = "snap"
    names = ("snapkv", "snap", "adakv")
    usage = "snapkv:BUDGET or adakv:BUDGET"
    store = "snap"

    def __post_init__(self) -> None:
        check_stored(self.bits, self.group, self.residual)

    def held_layout(self, n: int) -> Layout:
        """What a head holding ``n`` tokens (kept prompt tokens, then later ones) stores: at 16 bits all of them in
        the cache's dtype; quantized, the sequence of its held tokens stored as ``kv.full(bits)`` stores a
        sequence (KIVI: keys quantized a ``residual`` at a time, values all but the last ``residual``); and the
        int64 position of each."""
        held = Layout(n, n) if self.bits == 16 else held_layout(self, n, start=0, low=0)
        return replace(held, positions=n)

    def group_total(self, heads: int) -> int:
        """The prompt tokens ``heads`` kv heads under this rule keep together (prompts longer than that)."""
        if self.total is not None:
            return self.total
        assert self.budget is not None  # exactly one of budget, total is given
        return self.budget * heads

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
            raise ConfigError(
                f"layer {layer}: {heads} kv heads share total={total} prompt tokens under Ada-KV, but "
                f"each keeps at least floor={max(floor, self.window)} (its observation window "
                f"included): {heads} x {max(floor, self.window)} > {total}; raise the total or lower "
                "the floor"
            )

    def layouts(self, heads: int, tokens: int, prompt: int | None = None) -> list[Layout]:
        """The prompt's kept tokens (``min(prompt, budget)`` per head; Ada-KV: ``min(total, heads x prompt)`` split
        evenly, the real split being the data's) plus every token after it."""
        p = tokens if prompt is None else prompt
        if not 0 <= p <= tokens:
            raise ConfigError(f"prompt={p} and tokens={tokens}: give 0 <= prompt <= tokens")
        after = tokens - p
        if not self.adaptive:
            assert self.budget is not None  # SnapKV's fixed budget
            return [self.held_layout(min(p, self.budget) + after)] * heads
        q, r = divmod(min(self.group_total(heads), heads * p), heads) if heads else (0, 0)
        return [self.held_layout(q + (i < r) + after) for i in range(heads)]

    def layout(self, tokens: int, prompt: int | None = None) -> Layout:
        if self.adaptive and self.total is not None:
            raise ConfigError(
                "an Ada-KV rule with a total shares it among the heads of a layer: ask "
                "Policy.layouts (or rule.layouts(heads, ...)) for what each head holds"
            )
        return self.layouts(1, tokens, prompt)[0]

    def kept(self, tokens: int, prompt: int | None = None) -> int:
        return self.layout(tokens, prompt).full_keys

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        raise ConfigError(
            f"{self!r} keeps the prompt tokens its observation window attends to: which ones depends on "
            "the prompt, not on positions alone; HeadCache.positions(layer, kv_head) gives them after "
            "the prefill"
        )

    def text(self) -> str:
        """What :func:`as_rule` reads back: ``snapkv:256,window=32,pool=7``, ``adakv:total=768,floor=64,...``."""
        opts = [f"window={self.window}", f"pool={self.pool}"] + (["pooling=avg"] if self.pooling != "max" else [])
        opts += precision_items(self)
        if not self.adaptive:
            return ",".join([f"snapkv:{self.budget}"] + opts)
        size = f"total={self.total}" if self.total is not None else str(self.budget)
        return ",".join([f"adakv:{size}"] + ([f"floor={self.floor}"] if self.floor is not None else []) + opts)

    def label(self) -> str:
        """What tables call a uniform policy of it: ``SnapKV 256``, ``Ada-KV 256/head``, ``Ada-KV 768/layer``."""
        bits = f" {self.bits}-bit" if self.bits != 16 else ""
        if not self.adaptive:
            return f"SnapKV {self.budget}{bits}"
        return (f"Ada-KV {self.budget}/head" if self.total is None else f"Ada-KV {self.total}/layer") + bits

    @classmethod
    def from_text(cls, text: str, name: str, parts: list[str] | None) -> Snap:
        """``snapkv:BUDGET[,window=W,pool=P,pooling=max|avg]``, ``adakv:BUDGET`` or ``adakv:total=T`` (and
        ``floor=F``)."""
        parts = parts or []
        allowed = ("window", "pool", "pooling", "bits", "group", "residual") + (
            ("total", "floor") if name == "adakv" else ()
        )
        example = f"{name}:256,window=32,pool=7" + (" or adakv:total=768,floor=64" if name == "adakv" else "")
        opts: dict = {}
        budget = None
        for i, item in enumerate(parts):
            key, eq, val = (p.strip() for p in item.partition("="))
            if not eq and i == 0:
                key, val = "budget", key
            elif key not in allowed or not eq:
                raise ConfigError(
                    f"kv rule {text!r}: unknown option {item!r}; {name} takes "
                    f"{', '.join(a + '=' for a in allowed)} (e.g. {example})"
                )
            if key == "pooling":
                opts[key] = val
                continue
            try:
                num = int(val)
            except ValueError:
                raise ConfigError(f"kv rule {text!r}: {key} takes an integer, got {val!r} (e.g. {example})") from None
            if key == "budget":
                budget = num
            else:
                opts[key] = num
        if name == "adakv":
            return adakv(budget, **opts)
        if budget is None:
            raise ConfigError(
                f"kv rule {text!r}: write {name}:BUDGET, the prompt tokens each kv head keeps (e.g. {example})"
            )
        return snap(budget, **opts)

    def __repr__(self) -> str:
        opts = f"window={self.window}, pool={self.pool}" + (", pooling='avg'" if self.pooling != "max" else "")
        if self.bits != 16:
            opts += f", bits={self.bits}, group={self.group}, residual={self.residual}"
        if not self.adaptive:
            return f"snap({self.budget}, {opts})"
        size = f"total={self.total}" if self.total is not None else f"{self.budget}"
        floor = f", floor={self.floor}" if self.floor is not None else ""
        return f"adakv({size}{floor}, {opts})"


def _check_snap(window, pool, pooling) -> None:
    check_count("window", window, low=1)
    check_count("pool", pool, low=1)
    if pool % 2 == 0:
        raise ConfigError(
            f"pool={pool}: SnapKV pools the scores over an odd number of positions (centred on each "
            "key), e.g. pool=7; pool=1 pools nothing"
        )
    if pooling not in POOLINGS:
        raise ConfigError(f"pooling={pooling!r}: use 'max' (SnapKV's) or 'avg' (kvpress's)")


def snap(
    budget: int,
    window: int = 32,
    pool: int = 7,
    *,
    pooling: str = "max",
    bits: int = 16,
    group: int | None = None,
    residual: int | None = None,
) -> Snap:
    """SnapKV's rule for a kv head: after the prefill it keeps ``budget`` prompt tokens, the last ``window`` (the
    observation window) and the ``budget - window`` earlier ones the window attends to most, then every new token.

    ``bits`` 8, 4 or 2 stores what each head keeps as KIVI's codes (``group``, ``residual``: as :data:`~headlab.kv.
    full`'s), its held tokens in order taken as the sequence quantized; the selection runs on the prompt's keys
    in full precision, and a decode step attends on the codes. A prompt of at most ``budget`` tokens is kept
    whole. The prompt must be at least ``window`` tokens
    (:class:`~headlab.errors.InputError` at the prefill). Raises :class:`~headlab.errors.ConfigError` for a
    budget or window below 1, a budget below the window, an even pool, or a pooling other than "max", "avg".
    """
    check_count("budget", budget, low=1)
    _check_snap(window, pool, pooling)
    if budget < window:
        raise ConfigError(
            f"snap(budget={budget}, window={window}): the budget counts the observation window it "
            f"always keeps; give budget >= window (e.g. snap({max(budget, 4 * window)}, window={window}))"
        )
    return Snap(budget, window, pool, pooling, False, None, None, *check_precision(bits, group, residual))


def adakv(
    budget: int | None = None,
    *,
    total: int | None = None,
    floor: int | None = None,
    window: int = 32,
    pool: int = 7,
    pooling: str = "max",
    bits: int = 16,
    group: int | None = None,
    residual: int | None = None,
) -> Snap:
    """Ada-KV's rule (Feng et al. 2024) on SnapKV's scores: the kv heads of a layer that follow it keep ``total``
    prompt tokens together (or ``budget`` per head on average: ``budget x heads``), the highest scores over all
    of them jointly, each head at least ``floor`` (its window included; default: the window plus a fifth of the
    average share past it, Ada-KV's alpha = 0.2). A head whose window attends to a few tokens gives its share to
    heads that spread their attention. ``bits``, ``group``, ``residual``: as :func:`snap`'s.

    Raises :class:`~headlab.errors.ConfigError` unless exactly one of ``budget``, ``total`` is given, for a
    floor below the window or above the budget, and (when the policy meets the model) for ``floor x heads >
    total``.
    """
    if (budget is None) == (total is None):
        raise ConfigError(
            "adakv takes budget= (prompt tokens per kv head, on average) or total= (per layer), "
            "exactly one of them, e.g. adakv(256) or adakv(total=768)"
        )
    _check_snap(window, pool, pooling)
    size = budget if budget is not None else total
    assert size is not None  # exactly one of them, checked above
    check_count("budget" if budget is not None else "total", size, low=1)
    if budget is not None and budget < window:
        raise ConfigError(
            f"adakv(budget={budget}, window={window}): the budget counts the observation window every "
            "head keeps; give budget >= window"
        )
    if floor is not None:
        check_count("floor", floor, low=1)
        if floor < window:
            raise ConfigError(
                f"floor={floor} < window={window}: every head keeps its observation window, so its "
                f"floor is at least the window (floor counts it)"
            )
        if floor > size:
            raise ConfigError(
                f"floor={floor} is more than the {'budget' if budget is not None else 'total'} "
                f"{size}: each head would keep more than the heads share"
            )
    return Snap(budget, window, pool, pooling, True, total, floor, *check_precision(bits, group, residual))
