"""What a KV rule is (:class:`Rule`, one object that answers all headlab asks of a rule), the registry of kinds
(:data:`RULES`, :func:`register_rule`) and the rules that depend on positions alone (:data:`full`, :data:`drop`,
:func:`window`), with KIVI's precision; re-exported by :mod:`headlab.kv`. What a head holds (:class:`Layout`) is
:mod:`headlab.decode.layout`'s.
A new kind is one class, a frozen dataclass subclassing :class:`Rule`, decorated with :func:`register_rule`.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass

import torch

from headlab.decode.layout import Layout, held_layout
from headlab.decode.rule_checks import BITS, GROUP, RESIDUAL, check_precision, check_stored, check_window
from headlab.errors import ConfigError
from headlab.registry import Registry
from headlab.spec import masks

__all__ = [
    "BITS",
    "GROUP",
    "RESIDUAL",
    "RULES",
    "Rule",
    "Full",
    "Drop",
    "Window",
    "full",
    "drop",
    "window",
    "precision_items",
    "register_rule",
    "unregister_rule",
    "unknown_rule",
    "usages",
]


class Rule:
    """What one kv head keeps. The policy, the cache and the cost model ask the rule, never its type:

    - ``visible(q_pos, k_pos)``: may a query at ``q_pos`` see the key at ``k_pos`` (broadcast integer tensors ->
      bool); decoding equals one forward with this mask (keys keep their positions; SnapKV's refuses: its keys
      follow from the prompt).
    - ``retain(pos, last)``: its eviction, the held keys (at ``pos <= last``) that stay once the query at ``last``
      has attended: every key a later query sees, all seen by ``last`` (the default, what ``last`` sees, is both
      when visibility only shrinks as queries advance).
    - ``kept``, ``layout``, ``layouts``: what a head holds after ``tokens`` tokens (:class:`Layout`, whose bytes
      the cost model counts), the first ``prompt`` of them the prefill.
    - ``store``: which store holds its heads in a cache layer, a name in :data:`headlab.decode.cache.STORES`;
      ``sinks``: the first keys it holds for good; ``prefill``: its attention on a prompt. A rule that evicts first
      in, first out past its sinks (a window) gives ``ring``, the most keys it holds, and ``horizon(last)``, the
      oldest position past the sinks the query at ``last`` sees: its stores overwrite in place and cut by position.
    - ``text()`` / ``from_text`` (what :func:`~headlab.kv.as_rule` reads under ``names``), ``label()``, ``kind``
      (what :meth:`~headlab.kv.Policy.counts` calls it), ``check_heads`` (refuse a layer it cannot serve).
    """

    kind = "rule"
    names: tuple[str, ...] = ()  # the names its text starts with: "window" in "window:4,256"
    usage = ""  # its text, as the unknown-rule message shows it
    bits = 16
    sinks = 0
    ring: int | None = None
    compensate = False
    evicts = True  # False: it keeps every key it takes (no eviction to run)
    store = "plain"

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def retain(self, pos: torch.Tensor, last: int) -> torch.Tensor:
        """``(held,)`` bool: the held keys at ``pos`` that stay once the query at ``last`` has attended."""
        return self.visible(torch.as_tensor(last), pos)

    def horizon(self, last):  # pragma: no cover - rules with a ring have one
        raise NotImplementedError

    def kept(self, tokens: int, prompt: int | None = None) -> int:  # pragma: no cover - every kind has one
        raise NotImplementedError

    def layout(self, tokens: int, prompt: int | None = None) -> Layout:
        n = self.kept(tokens, prompt)  # keys and values in the cache's dtype
        return Layout(n, n)

    def layouts(self, heads: int, tokens: int, prompt: int | None = None) -> list[Layout]:
        return [self.layout(tokens, prompt)] * heads  # each of a layer's heads under the rule (shared budgets split)

    def check_heads(self, heads: int, layer: int) -> None:
        """Refuse to serve ``heads`` kv heads of ``layer`` (nothing to refuse for a per-head rule)."""

    def prefill(self, attention, q, k, v, scale, *, backend: str = "auto", return_lse: bool = False):
        """A prompt's queries ``q (B, heads, n, d)`` on its keys and values (positions ``0..n-1``) through ``attention``
        (:func:`headlab.attention`'s signature): here with the visibility as a dense mask (kinds may do better)."""
        pos = torch.arange(q.shape[2])
        vis = self.visible(pos[:, None], pos[None, :]).to(q.device)  # (n, n)
        return attention(q, k, v, mask=vis, scale=scale, return_lse=return_lse)

    def text(self) -> str:
        return self.names[0]

    def label(self) -> str:
        return self.text()

    @classmethod
    def from_text(cls, text: str, name: str, parts: list[str] | None) -> Rule:  # pragma: no cover
        """The rule of ``text`` named ``name``; ``parts``: the items after the colon (None: no colon)."""
        raise NotImplementedError


def _taken(cls: type[Rule], names: list[str]) -> ConfigError:
    return ConfigError(
        f"a kv rule named {names[0]!r} is already registered ({RULES[names[0]].__name__}); "
        f"unregister_rule({names[0]!r}) first"
    )


_RULES: Registry[type[Rule]] = Registry(
    "a kv rule",
    "its text starts with it",
    instances=False,
    key=lambda c: c.names,
    strict=True,
    taken=_taken,
    unknown=lambda name, names: ConfigError(f"no kv rule {name!r} is registered; the rules: {', '.join(names)}"),
)
RULES: MutableMapping[str, type[Rule]] = _RULES.table  # a rule text's name -> its kind (as_rule reads "name:args")


def register_rule(cls: type[Rule]) -> type[Rule]:
    """Class decorator: register a kind of rule under its ``names``, which :func:`~headlab.kv.as_rule` (policy texts
    and files, ``--policy``) then reads. Refuses a class that is not a complete :class:`Rule`, or a name taken."""
    if not (isinstance(cls, type) and issubclass(cls, Rule)):
        raise ConfigError(f"register_rule takes a subclass of headlab.kv.Rule, got {cls!r}")
    own = set().union(*(vars(c) for c in cls.__mro__[: cls.__mro__.index(Rule)]))
    missing = [m for m in ("visible", "from_text") if m not in own]
    missing += [] if own & {"kept", "layout", "layouts"} else ["kept"]
    if missing:
        raise ConfigError(
            f"rule kind {cls.__name__} does not define {', '.join(missing)}: a rule answers its "
            "visibility, what it keeps, its text and how to read it back"
        )
    if not cls.names or not all(
        isinstance(n, str) and n and n == n.strip().lower() and not set(n) & set(":,") for n in cls.names
    ):
        raise ConfigError(
            f"rule kind {cls.__name__}: names={cls.names!r}; give its text names, lower case, without "
            "':' or ',' (e.g. names = ('strided',))"
        )
    return cls if all(RULES.get(n) is cls for n in cls.names) else _RULES.register(cls)  # once is enough


def unregister_rule(name: str) -> type[Rule]:
    """Remove the kind of rule registered as ``name`` (under all its names) and return its class."""
    cls = _RULES.unregister(name)
    assert cls is not None  # a strict registry raises for an unknown name
    return cls


def usages() -> str:
    """Every registered rule as its usage text says it (``full, drop, streaming:SINK,RECENT (e.g. ...), ...``): the
    words of the unknown-rule message and of ``headlab generate --help``'s ``--policy``."""
    return ", ".join(dict.fromkeys(c.usage or c.names[0] for c in RULES.values()))


def unknown_rule(text: str) -> ConfigError:
    return ConfigError(
        f"unknown kv rule {text!r}: use {usages()}, with options such as full:bits=4, "
        "streaming:4,256,bits=2,compensate or snapkv:256,window=32,pool=7"
    )


def _precision_text(r) -> str:
    if r.bits == 16:
        return ""
    extra = "" if (r.group, r.residual) == (GROUP, RESIDUAL) else f", group={r.group}, residual={r.residual}"
    return f"bits={r.bits}{extra}"


def precision_items(r) -> list[str]:
    """The precision options of a quantized rule's text (``bits=``, ``group=``, ``residual=``); none at 16 bits."""
    return [f"bits={r.bits}", f"group={r.group}", f"residual={r.residual}"] if r.bits != 16 else []


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _options(x, name: str, items: list[str]) -> dict:
    """``key=value`` items of a full or window rule's text (``compensate`` alone means ``compensate=true``)."""
    opts: dict = {}
    for item in items:
        key, eq, val = (p.strip() for p in item.partition("="))
        if key == "compensate" and name != "full":
            val = val if eq else "true"
            if val not in _TRUE + _FALSE:
                raise ConfigError(f"kv rule {x!r}: compensate takes true or false, got {val!r}")
            opts["compensate"] = val in _TRUE
            continue
        if key not in ("bits", "group", "residual") or not eq:
            allowed = "bits=, group=, residual=" + (", compensate" if name != "full" else "")
            raise ConfigError(
                f"kv rule {x!r}: unknown option {item.strip()!r}; {name} takes {allowed} "
                f"(e.g. {name}:{'4,256,' if name != 'full' else ''}bits=4)"
            )
        try:
            opts[key] = int(val)
        except ValueError:
            raise ConfigError(f"kv rule {x!r}: {key} takes an integer, got {val!r}") from None
    return opts


@register_rule
@dataclass(frozen=True)
class Full(Rule):
    """Keep every key (the ordinary cache), at ``bits`` bits (16: the cache's dtype; 8, 4, 2: quantized as KIVI):
    ``kv.full`` is the 16-bit rule; ``kv.full(bits=4)`` (a call of it) the same rule with 4-bit keys and values."""

    bits: int = 16
    group: int = GROUP  # quantized rules: tokens per key scale (per channel), channels per value scale
    residual: int = RESIDUAL  # quantized rules: the most recent tokens kept in full precision

    kind = "full"
    names = ("full",)
    evicts = False

    def __post_init__(self) -> None:  # kv.Full(bits=3) is refused as kv.full(bits=3) is, not inside a decode
        check_stored(self.bits, self.group, self.residual)

    def __call__(self, bits: int = 16, *, group: int | None = None, residual: int | None = None) -> Full:
        """``kv.full(bits=4, group=32, residual=128)``: every key kept, quantized (Liu et al. 2024, KIVI)."""
        return Full(*check_precision(bits, group, residual))

    @property
    def store(self) -> str:  # type: ignore[override]  # from the rule's fields: a property where others declare it
        return "plain" if self.bits == 16 else "quant"

    def kept(self, tokens: int, prompt: int | None = None) -> int:
        return tokens

    def layout(self, tokens: int, prompt: int | None = None) -> Layout:
        return held_layout(self, tokens, start=0, low=0)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return k_pos <= q_pos

    def prefill(self, attention, q, k, v, scale, *, backend: str = "auto", return_lse: bool = False):
        return attention(q, k, v, causal=True, scale=scale, **({"return_lse": True} if return_lse else {}))

    def text(self) -> str:
        return "full:" + ",".join(precision_items(self)) if self.bits != 16 else "full"

    def label(self) -> str:
        return "full" + (f" {self.bits}-bit" if self.bits != 16 else "")

    @classmethod
    def from_text(cls, text: str, name: str, parts: list[str] | None) -> Full:
        if parts is None:
            return full
        if not parts:
            raise unknown_rule(text)
        opts = _options(text, "full", parts)
        return full(opts.pop("bits", 16), **opts)

    def __repr__(self) -> str:
        p = _precision_text(self)
        return f"full({p})" if p else "full"


@register_rule
@dataclass(frozen=True)
class Drop(Rule):
    """Keep nothing: the kv head and its query heads are pruned (their output is zero)."""

    kind = "drop"
    names = ("drop",)
    store = "none"

    def kept(self, tokens: int, prompt: int | None = None) -> int:
        return 0

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(k_pos <= q_pos)

    @classmethod
    def from_text(cls, text: str, name: str, parts: list[str] | None) -> Drop:
        if parts is not None:
            raise unknown_rule(text)
        return drop

    def __repr__(self) -> str:
        return "drop"


@register_rule
@dataclass(frozen=True)
class Window(Rule):
    """Keep the first ``sink`` keys (attention sinks) and the last ``recent`` keys; with ``compensate``, one more
    key/value pair holding the mean of the evicted ones (RazorAttention). Query ``t`` sees key ``j`` when
    ``j <= t`` and ``(j < sink or t - j < recent)``: the arithmetic of the window, here only."""

    sink: int  # the first keys every query keeps seeing (StreamingLLM uses 4)
    recent: int  # how many of the latest keys, the query's own included, stay visible
    bits: int = 16
    group: int = GROUP
    residual: int = RESIDUAL
    compensate: bool = False

    kind = "window"
    names = ("window", "streaming")
    usage = "streaming:SINK,RECENT (e.g. streaming:4,256)"

    def __post_init__(self) -> None:  # kv.Window(-1, 4) is refused as kv.window(-1, 4) is, not inside a decode
        check_window(self.sink, self.recent, self.compensate)
        check_stored(self.bits, self.group, self.residual)

    @property
    def sinks(self) -> int:  # type: ignore[override]  # from the rule's fields: a property where others declare it
        return self.sink

    @property
    def ring(self) -> int:  # type: ignore[override]  # as sinks
        return self.sink + self.recent

    @property
    def store(self) -> str:  # type: ignore[override]  # as sinks
        return "quant" if self.bits != 16 or self.compensate else "plain"

    def horizon(self, last):
        return last - self.recent + 1

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return (k_pos <= q_pos) & ((k_pos < self.sink) | (k_pos >= self.horizon(q_pos)))

    def kept(self, tokens: int, prompt: int | None = None) -> int:
        return min(tokens, self.ring) + self.compensation(tokens)

    def compensation(self, tokens: int) -> int:
        """1 when the rule holds a compensation token after ``tokens`` tokens (some key was evicted), else 0."""
        return int(self.compensate and tokens > self.ring)

    def layout(self, tokens: int, prompt: int | None = None) -> Layout:
        lay = held_layout(self, tokens, start=self.sink, low=max(self.sink, self.horizon(tokens - 1)))
        comp = self.compensation(tokens)
        return Layout(
            lay.full_keys, lay.full_values, lay.quant_keys, lay.quant_values, lay.key_groups, lay.bits, lay.group, comp
        )

    def prefill(self, attention, q, k, v, scale, *, backend: str = "auto", return_lse: bool = False):
        """The prefill ``(B, heads, n, d)`` without any ``n x n`` matrix: the keys query ``t`` sees are the band
        ``0 <= t - j < recent`` (a sliding window, which the sparse kernel runs as a band: ``backend``) and the sinks
        ``j < sink`` outside it (at most ``sink`` per row). Each part returns its output and log-sum-exp; they merge
        as FlashAttention merges tiles: ``lse = logaddexp(l1, l2)``, ``out = o1 e^(l1 - lse) + o2 e^(l2 - lse)``."""
        n = q.shape[2]
        parts = []
        if self.recent >= 2:
            parts.append(
                attention(
                    q,
                    k,
                    v,
                    mask=masks.sliding_window(self.recent - 1, causal=True),
                    scale=scale,
                    backend=backend,
                    return_lse=True,
                )
            )
        elif self.recent == 1:
            parts.append(
                attention(q, k, v, mask=masks.as_mask(lambda b, h, i, j: i == j), scale=scale, return_lse=True)
            )
        if self.sink:
            s = min(self.sink, n)
            t, j = torch.arange(n)[:, None], torch.arange(s)[None, :]
            outside = (self.visible(t, j) & (t - j >= self.recent)).to(q.device)  # (n, s): sinks outside the band
            parts.append(attention(q, k[:, :, :s], v[:, :, :s], mask=outside, scale=scale, return_lse=True))
        if len(parts) == 1:
            return parts[0] if return_lse else parts[0][0]
        (o1, l1), (o2, l2) = parts  # a row with no sink outside its band: l2 = -inf, weight 0
        lse = torch.logaddexp(l1, l2)
        w2 = torch.exp(l2 - lse).nan_to_num(0.0).unsqueeze(-1)
        out = o1.mul_(torch.exp(l1 - lse).unsqueeze(-1)).add_(o2.mul_(w2))
        return (out, lse) if return_lse else out

    def text(self) -> str:
        return ",".join(
            [f"window:{self.sink}", str(self.recent)]
            + precision_items(self)
            + (["compensate"] if self.compensate else [])
        )

    def label(self) -> str:
        return (
            f"streaming {self.sink}+{self.recent}"
            + (f" {self.bits}-bit" if self.bits != 16 else "")
            + (" compensated" if self.compensate else "")
        )

    @classmethod
    def from_text(cls, text: str, name: str, parts: list[str] | None) -> Window:
        parts = parts or []
        nums_text = [p for p in parts if "=" not in p and p != "compensate"]
        try:
            nums = [int(p) for p in nums_text]
        except ValueError:
            nums = []
        if len(nums) != 2 or parts[:2] != nums_text:
            raise ConfigError(
                f"kv rule {text!r}: write {name}:SINK,RECENT with two integers, then any options, e.g. "
                f"{name}:4,256 or {name}:4,256,bits=4,compensate"
            )
        return window(*nums, **_options(text, name, parts[2:]))

    def __repr__(self) -> str:
        p = _precision_text(self)
        extra = (f", {p}" if p else "") + (", compensate=True" if self.compensate else "")
        return f"window(sink={self.sink}, recent={self.recent}{extra})"


full = Full()
drop = Drop()


def window(
    sink: int = 4,
    recent: int = 256,
    *,
    bits: int = 16,
    group: int | None = None,
    residual: int | None = None,
    compensate: bool = False,
) -> Window:
    """The rule that keeps the first ``sink`` and the last ``recent`` keys of a kv head.

    ``bits`` (8, 4, 2) quantizes what it holds past the sinks as KIVI does (``group``, ``residual``: see
    :data:`full`); the sinks stay in full precision. ``compensate`` keeps one more key/value pair, the mean
    of the keys and values it evicted, weighted in the softmax by how many it stands for (Tang et al. 2024,
    RazorAttention).

    Raises :class:`~headlab.errors.ConfigError` for a negative count, or when both are 0 (a head
    that sees nothing: use :data:`drop` to prune it), or for bits other than 16, 8, 4, 2.
    """
    check_window(sink, recent, compensate)
    return Window(sink, recent, *check_precision(bits, group, residual), compensate)
