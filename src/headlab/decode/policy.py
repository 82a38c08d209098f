"""A KV-cache policy: a rule per ``(layer, kv_head)`` (:class:`Policy`), and a rule from its text (:func:`as_rule`,
through the registry of kinds, :data:`headlab.decode.rules.RULES`); re-exported by :mod:`headlab.kv`, whose docstring
says what the rules keep.

A policy is built from one rule (:meth:`Policy.uniform`, :meth:`Policy.parse`), a spec, a file
(:meth:`Policy.load`), or a ranking of the heads (:meth:`Policy.from_scores` and its named forms: importance, an
atlas, trained gates, a random control), and answers what each head sees and holds (:meth:`Policy.visible`,
:meth:`Policy.layouts`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import headlab.checks as checks
from headlab.decode import expected  # noqa: F401  (registers expected:BUDGET, which as_rule reads)
from headlab.decode.heads import kv_layout
from headlab.decode.layout import Layout
from headlab.decode.rule_checks import BITS, check_policy_data
from headlab.decode.rules import RULES, Rule, full, unknown_rule, window
from headlab.decode.snap_rule import adakv, snap
from headlab.errors import ConfigError
from headlab.results import envelope, write_json

__all__ = ["Policy", "as_rule", "visibility"]


def visibility(rule: Rule, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The rule's visibility for query positions ``q_pos`` and key positions ``k_pos`` (broadcast)."""
    return rule.visible(q_pos, k_pos)


def as_rule(x) -> Rule:
    """A rule from a rule or its text: ``"full"``, ``"drop"``, ``"window:SINK,RECENT"`` / ``"streaming:SINK,RECENT"``,
    each (but drop) with options: ``"full:bits=4"``, ``"streaming:4,256,bits=2,group=32,residual=128"``,
    ``"window:4,256,compensate"``; SnapKV ``"snapkv:256"`` (``"snapkv:256,window=32,pool=7,pooling=avg"``) and
    Ada-KV ``"adakv:256"`` (256 per kv head on average) or ``"adakv:total=768,floor=64"``; and the text of any
    kind registered with :func:`register_rule` (its name, a colon, its items: :data:`RULES` reads it)."""
    if isinstance(x, Rule):
        return x
    if not isinstance(x, str):
        raise ConfigError(
            f"a kv rule is kv.full, kv.drop, kv.window(sink, recent), kv.snap(budget), kv.adakv(budget) "
            f"or its text; got {x!r}"
        )
    name, colon, args = x.strip().lower().partition(":")
    kind = RULES.get(name)
    if kind is None:
        raise unknown_rule(x)
    return kind.from_text(x, name, ([p.strip() for p in args.split(",")] if args else []) if colon else None)


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
    def adakv(
        cls,
        budget: int | None = None,
        *,
        total_per_layer: int | None = None,
        floor: int | None = None,
        window: int = 32,
        pool: int = 7,
        pooling: str = "max",
    ) -> Policy:
        """Ada-KV on SnapKV's scores for every layer: its kv heads keep ``total_per_layer`` prompt tokens together (or
        ``budget`` per head on average), allocated by their scores jointly, each at least ``floor`` (:func:`adakv`)."""
        return cls.uniform(adakv(budget, total=total_per_layer, floor=floor, window=window, pool=pool, pooling=pooling))

    @classmethod
    def from_spec(cls, spec: Mapping, default="full", *, name: str = "spec") -> Policy:
        """``{(layer, kv_head): rule}`` (keys may also be ``"layer.kv_head"`` text); the rest ``default``."""
        if not isinstance(spec, Mapping):
            raise ConfigError(
                f"a policy spec must be an object {{(layer, kv_head) or 'layer.kv_head': rule}}, got "
                f"{type(spec).__name__}"
            )
        rules = {}
        for given, rule in spec.items():
            key = given
            if isinstance(key, str):
                try:
                    key = tuple(int(p) for p in key.split("."))
                except ValueError:
                    key = ()
            if not (isinstance(key, tuple) and len(key) == 2 and all(checks.is_int(i) for i in key)):
                raise ConfigError(f"policy key {given!r}: use (layer, kv_head) pairs of integers, or 'layer.kv_head'")
            if min(key) < 0:  # -1 is no "last" here: it would name a head no model has
                raise ConfigError(
                    f"policy key {given!r} names layer {key[0]}, kv head {key[1]}: layers and kv heads count from 0"
                )
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
            raise ConfigError(
                f"scores of shape {tuple(s.shape)} do not fit this model: expected (layers, heads) = "
                f"({len(heads)}, {max(heads)})"
            )
        for layer, h in enumerate(heads):  # a pruned layer's columns past its heads are not read
            bad = s[layer, :h].isnan().nonzero()
            if bad.numel():
                raise ConfigError(
                    f"scores hold NaN (layer {layer}, head {int(bad[0, 0])}, ...): a NaN cannot be "
                    "ranked; compute the scores again or replace the NaN with a number"
                )
        checks.probability(
            "keep",
            keep,
            message="keep={value!r} is the fraction of kv heads kept full: keep must be "
            "a number in [0, 1], got {value!r}",
        )
        per_kv = []
        for layer, (h, g) in enumerate(zip(heads, kvh)):
            rep = h // g
            for j in range(g):
                per_kv.append((float(s[layer, j * rep : (j + 1) * rep].max()), layer, j))
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
            raise ConfigError(
                f"the atlas has no {sorted(missing)} scores (it has {sorted(scores)}); build it with "
                "kinds including 'sink' and 'local'"
            )
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
        return cls.from_scores(
            model, scores, keep=keep, rest=rest, name=f"random {keep:.0%} full (seed {seed})", kept=kept
        )

    @classmethod
    def train(cls, model, *, keep: float, rest=None, kept=None, **options) -> Policy:
        """DuoAttention's learned split: train one gate per kv head (:func:`headlab.decode.train.train_gates`, whose
        ``options`` these are: ``steps``, ``seconds``, ``checkpoint``, ``progress``, ...), keep the ``keep`` share
        with the highest gates full and give the rest ``rest`` (default ``window(4, 256)``; the gates are trained
        against its window at 16 bits)."""
        from headlab.decode.train import train_gates  # here: training imports transformers, a policy does not

        r = as_rule(rest) if rest is not None else window(4, 256)
        if r.kind != "window":
            raise ConfigError(f"rest={rest!r}: a learned split windows the heads it does not keep; give kv.window(...)")
        gates = train_gates(model, rest=window(r.sink, r.recent), **options)  # type: ignore[attr-defined]  # kind "window": a Window
        return cls.from_gates(model, gates, keep=keep, rest=r, kept=kept)

    @classmethod
    def from_gates(cls, model, gates, *, keep: float, rest=None, kept=None) -> Policy:
        """The ``keep`` share of kv heads with the highest trained gates full, the rest ``rest`` (default: the window
        the gates were trained against). ``gates``: a :class:`~headlab.decode.train.GateTraining`, its saved JSON
        file, or a ``(layers, kv_heads)`` tensor."""
        from headlab.decode.train import GateTraining, per_query_head  # here: training imports transformers

        if isinstance(gates, str | os.PathLike):
            gates = GateTraining.load(gates)
        g = gates.gates if isinstance(gates, GateTraining) else torch.as_tensor(gates, dtype=torch.float64)
        default = gates.rest if isinstance(gates, GateTraining) else window(4, 256)
        return cls.from_scores(
            model,
            per_query_head(model, g),
            keep=keep,
            rest=rest if rest is not None else default,
            name=f"trained split {keep:.0%} full",
            kept=kept,
        )

    @classmethod
    def parse(cls, text: str) -> Policy:
        """A uniform policy from its text: ``full``, ``drop``, ``streaming:4,256`` (or ``window:4,256``), with options
        ``full:bits=4``, ``streaming:4,256,bits=2,group=32,residual=128``, ``streaming:4,256,compensate``; SnapKV
        ``snapkv:256`` (``snapkv:256,window=32,pool=7``), Ada-KV ``adakv:256`` or ``adakv:total=768,floor=64``."""
        return cls.uniform(as_rule(text))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Policy:
        """A policy saved with :meth:`save` or :meth:`to_json` (``{"default": ..., "heads": {"layer.kv_head": rule}}``,
        with or without the envelope's header: earlier files have none)."""
        from headlab.reading import read_json_file

        p = Path(path).expanduser()
        data = read_json_file(p, what="a policy file (Policy.save)")
        heads = check_policy_data(data, f"policy file {str(p)!r}")  # a mapping, or what the file holds instead
        name = data.get("name")
        return cls.from_spec(
            heads, data.get("default", "full"), name=name if isinstance(name, str) and name else p.stem
        )

    def as_dict(self) -> dict:
        """The policy as plain data, ``{"name", "default", "heads": {"layer.kv_head": rule text}}``: what
        :meth:`to_json` wraps and a :class:`~headlab.decode.generate.Generation` nests."""
        return {
            "name": self.name,
            "default": self.default.text(),
            "heads": {f"{l}.{h}": r.text() for (l, h), r in sorted(self.rules.items())},
        }

    def to_json(self) -> dict:
        """:meth:`as_dict` in headlab's envelope (kind ``kv_policy``); :meth:`load` and ``--kv-from`` read it."""
        return envelope("kv_policy", self.as_dict())

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_json` to ``path`` (atomically, :func:`headlab.results.write_json`)."""
        return write_json(path, self.to_json())

    # -- reading -------------------------------------------------------------------------------------------
    def rule(self, layer: int, kv_head: int) -> Rule:
        return self.rules.get((layer, kv_head), self.default)

    def check(self, kv_heads: Sequence[int], *, model: str = "the model") -> None:
        """Refuse rules for a layer or kv head the model lacks (``kv_heads``: kv heads per layer)."""
        for layer, head in self.rules:
            if not 0 <= layer < len(kv_heads):
                raise ConfigError(f"the policy names layer {layer}, but {model} has layers 0..{len(kv_heads) - 1}")
            if not 0 <= head < kv_heads[layer]:
                raise ConfigError(
                    f"the policy names kv head {head} of layer {layer}, but that layer has kv heads "
                    f"0..{kv_heads[layer] - 1} (grouped-query models have fewer kv heads than query heads)"
                )
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
        return [
            [lay.full_keys + lay.quant_keys + lay.compensation for lay in layer]
            for layer in self.layouts(tokens, kv_heads, prompt)
        ]

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
                if r.store != "none":
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
        return out  # type: ignore[return-value]  # every head filled: each rule answers for its own

    def check_shape(self, kv_heads: Sequence[int], head_dim: int, v_dim: int | None = None) -> None:
        """Refuse quantized rules whose groups or packing do not fit ``head_dim`` (and ``v_dim``)."""
        v_dim = head_dim if v_dim is None else v_dim
        for l, g in enumerate(kv_heads):
            for j, r in enumerate(self.layer_rules(l, g)):
                if r.bits == 16:
                    continue
                group: int = r.group  # type: ignore[attr-defined]  # a quantized rule (bits != 16) has a group
                if v_dim % group:
                    raise ConfigError(
                        f"kv head {j} of layer {l}: group={group} does not divide the head dimension "
                        f"{v_dim} (values are quantized per token in groups of channels); give a group "
                        f"that divides it, e.g. group={math.gcd(v_dim, group)}"
                    )
                for what, d in (("head", head_dim), ("value", v_dim)):
                    if d * r.bits % 8:
                        raise ConfigError(
                            f"kv head {j} of layer {l}: a {what} dimension of {d} at {r.bits} bits "
                            "does not fill whole bytes; quantize it at 8 bits"
                        )


def _atlas_scores(atlas) -> dict[str, torch.Tensor]:
    if isinstance(atlas, str | os.PathLike):
        from headlab.reading import read_json_file

        atlas = read_json_file(atlas, what="an atlas file (headlab atlas --out DIR writes atlas.json)")
    raw = getattr(atlas, "scores", None)
    if raw is None and isinstance(atlas, Mapping):
        raw = atlas.get("scores", atlas)
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"from_atlas takes an atlas (with .scores), a dict of scores or an atlas JSON path; got "
            f"{type(atlas).__name__}"
        )
    out = {}
    for k, v in raw.items():
        try:
            t = torch.as_tensor(v, dtype=torch.float64)
        except (TypeError, ValueError):
            continue
        if t.dim() == 2:
            out[k] = t.nan_to_num(0.0)
    return out
