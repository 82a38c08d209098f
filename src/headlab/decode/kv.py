"""KV-cache policies per kv head: which keys each head keeps while a model decodes.

A **rule** says what one kv head of one layer holds:

- :data:`full` keeps every key (the ordinary cache);
- :func:`window(sink, recent) <window>` keeps the first ``sink`` keys and the last ``recent`` ones
  (StreamingLLM's attention sinks plus a sliding window, Xiao et al. 2024);
- :data:`drop` keeps nothing: the kv head is pruned, with the query heads that read it (their
  output is zero, as if their W^O columns were removed).

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
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from headlab.errors import ConfigError, InputError, ModelError

__all__ = ["Full", "Window", "Drop", "Rule", "full", "drop", "window", "Policy", "kv_layout"]


@dataclass(frozen=True)
class Full:
    """Keep every key (the ordinary cache)."""

    def kept(self, tokens: int) -> int:
        return tokens

    def __repr__(self) -> str:
        return "full"


@dataclass(frozen=True)
class Drop:
    """Keep nothing: the kv head and its query heads are pruned (their output is zero)."""

    def kept(self, tokens: int) -> int:
        return 0

    def __repr__(self) -> str:
        return "drop"


@dataclass(frozen=True)
class Window:
    """Keep the first ``sink`` keys (attention sinks) and the last ``recent`` keys."""

    sink: int     # the first keys every query keeps seeing (StreamingLLM uses 4)
    recent: int   # how many of the latest keys, the query's own included, stay visible

    def kept(self, tokens: int) -> int:
        return min(tokens, self.sink + self.recent)

    def __repr__(self) -> str:
        return f"window(sink={self.sink}, recent={self.recent})"


Rule = Full | Window | Drop
full = Full()
drop = Drop()


def window(sink: int = 4, recent: int = 256) -> Window:
    """The rule that keeps the first ``sink`` and the last ``recent`` keys of a kv head.

    Raises :class:`~headlab.errors.ConfigError` for a negative count, or when both are 0 (a head
    that sees nothing: use :data:`drop` to prune it).
    """
    for name, val in (("sink", sink), ("recent", recent)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise ConfigError(f"window {name} must be an integer, got {val!r}")
        if val < 0:
            raise ConfigError(f"window {name}={val} is negative; give a count of keys >= 0, e.g. window(sink=4, recent=256)")
    if sink + recent == 0:
        raise ConfigError("window(sink=0, recent=0) keeps no key, so its heads would see nothing; keep at least one "
                          "key (e.g. window(sink=4, recent=256)), or use kv.drop to prune the head")
    return Window(sink, recent)


def as_rule(x) -> Rule:
    """A rule from a rule or its text: ``"full"``, ``"drop"``, ``"window:SINK,RECENT"`` / ``"streaming:SINK,RECENT"``."""
    if isinstance(x, Full | Window | Drop):
        return x
    if not isinstance(x, str):
        raise ConfigError(f"a kv rule is kv.full, kv.drop, kv.window(sink, recent) or its text; got {x!r}")
    text = x.strip().lower()
    if text == "full":
        return full
    if text == "drop":
        return drop
    name, _, args = text.partition(":")
    if name in ("window", "streaming"):
        parts = [p.strip() for p in args.split(",")] if args else []
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            nums = []
        if len(nums) != 2:
            raise ConfigError(f"kv rule {x!r}: write {name}:SINK,RECENT with two integers, e.g. {name}:4,256")
        return window(*nums)
    raise ConfigError(f"unknown kv rule {x!r}: use full, drop, or streaming:SINK,RECENT (e.g. streaming:4,256)")


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
        return cls({}, r, name or (f"streaming {r.sink}+{r.recent}" if isinstance(r, Window) else repr(r)))

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
    def from_scores(cls, model, scores, *, keep: float, rest=None, name: str = "scores") -> Policy:
        """Keep the ``keep`` fraction of kv heads with the highest ``scores`` full; the others follow ``rest``.

        Args:
            model: a model, LoadedModel or adapter (for its heads and kv heads per layer).
            scores: ``(layers, heads)`` per *query* head (higher = needs the whole context). A kv head
                takes the maximum over its query heads (kept full when any of them needs it).
            keep: fraction of kv heads kept full, in ``[0, 1]`` (rounded to whole heads).
            rest: the rule for the others (default ``window(4, 256)``).
        """
        heads, kvh = kv_layout(model)
        s = torch.as_tensor(scores, dtype=torch.float64)
        if s.dim() != 2 or s.shape[0] != len(heads) or s.shape[1] < max(heads):
            raise ConfigError(f"scores of shape {tuple(s.shape)} do not fit this model: expected (layers, heads) = "
                              f"({len(heads)}, {max(heads)})")
        if not 0.0 <= keep <= 1.0:
            raise ConfigError(f"keep={keep} is the fraction of kv heads kept full: give a number in [0, 1]")
        per_kv = []
        for layer, (h, g) in enumerate(zip(heads, kvh)):
            rep = h // g
            for j in range(g):
                per_kv.append((float(s[layer, j * rep:(j + 1) * rep].nan_to_num(float("inf")).max()), layer, j))
        n_full = round(keep * len(per_kv))
        ranked = sorted(per_kv, key=lambda t: (-t[0], t[1], t[2]))
        chosen = {(l, j) for _, l, j in ranked[:n_full]}
        r = as_rule(rest) if rest is not None else window(4, 256)
        return cls({(l, j): (full if (l, j) in chosen else r) for _, l, j in per_kv}, r, name)

    @classmethod
    def from_importance(cls, model, importance, *, keep: float, rest=None) -> Policy:
        """The most important heads full (Michel et al. 2019's scores, ``headlab.head_importance``), the rest ``rest``.

        ``importance``: an :class:`~headlab.interpret.heads.importance.ImportanceResult` or a ``(layers, heads)`` tensor.
        """
        scores = getattr(importance, "scores", importance)
        return cls.from_scores(model, scores, keep=keep, rest=rest, name=f"importance {keep:.0%} full")

    @classmethod
    def from_atlas(cls, model, atlas, *, keep: float, rest=None) -> Policy:
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
        return cls.from_scores(model, need, keep=keep, rest=rest, name=f"atlas split {keep:.0%} full")

    @classmethod
    def random(cls, model, *, keep: float, rest=None, seed: int = 0) -> Policy:
        """The control: a random ``keep`` fraction of kv heads full (seeded), the rest ``rest``."""
        heads, _ = kv_layout(model)
        g = torch.Generator().manual_seed(seed)
        scores = torch.rand(len(heads), max(heads), generator=g, dtype=torch.float64)
        return cls.from_scores(model, scores, keep=keep, rest=rest, name=f"random {keep:.0%} full (seed {seed})")

    @classmethod
    def parse(cls, text: str) -> Policy:
        """A uniform policy from its text: ``full``, ``drop``, ``streaming:4,256`` (or ``window:4,256``)."""
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
        return {"name": self.name, "default": _rule_text(self.default),
                "heads": {f"{l}.{h}": _rule_text(r) for (l, h), r in sorted(self.rules.items())}}

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

    def layer_rules(self, layer: int, n_kv: int) -> list[Rule]:
        return [self.rule(layer, h) for h in range(n_kv)]

    def kept(self, tokens: int, kv_heads: Sequence[int]) -> list[list[int]]:
        """Keys held per ``[layer][kv_head]`` once ``tokens`` tokens have been cached."""
        self.check(kv_heads)
        return [[r.kept(tokens) for r in self.layer_rules(l, g)] for l, g in enumerate(kv_heads)]

    def visible(self, layer: int, kv_head: int, q_len: int, kv_len: int | None = None) -> torch.Tensor:
        """``(q_len, kv_len)`` bool: may query ``t`` see key ``j`` under this head's rule (positions from 0)."""
        return visibility(self.rule(layer, kv_head), torch.arange(q_len)[:, None], torch.arange(kv_len or q_len)[None])

    def counts(self, kv_heads: Sequence[int]) -> dict[str, int]:
        """How many kv heads are full, windowed and dropped."""
        out = {"full": 0, "window": 0, "drop": 0}
        for l, g in enumerate(kv_heads):
            for r in self.layer_rules(l, g):
                out["window" if isinstance(r, Window) else repr(r)] += 1
        return out


def visibility(rule: Rule, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The rule's visibility for query positions ``q_pos`` and key positions ``k_pos`` (broadcast)."""
    causal = k_pos <= q_pos
    if isinstance(rule, Full):
        return causal
    if isinstance(rule, Drop):
        return torch.zeros_like(causal)
    return causal & ((k_pos < rule.sink) | (q_pos - k_pos < rule.recent))


def _rule_text(r: Rule) -> str:
    return f"window:{r.sink},{r.recent}" if isinstance(r, Window) else repr(r)


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
