"""A learned head split: one gate per kv head, trained as DuoAttention does (Xiao et al. 2024).

Each kv head ``(l, j)`` gets a gate ``a[l, j]``; in a training forward every query head of that kv head
returns the mix of its two possible outputs,

    out = a * attention(full cache) + (1 - a) * attention(sink + recent window)      (a clamped to [0, 1])

with the model's weights frozen. The loss on a synthetic passkey context (:func:`headlab.decode.passkey.recital`:
labelled keys in filler text, then recited) is the distance between the full model's last hidden states and
the mixed model's at the rows that predict a recited key, plus an L1 term that pulls every gate towards the
window,

    loss = mean over those rows of ||h_full - h_mixed||^2 / dim  +  l1 * mean |a|

A head whose window loses what the recital needs keeps a high gate; the others fall. The gates rank the
kv heads (``kv.Policy.from_gates``, or ``kv.Policy.train`` for both steps), so a split at any share of full
heads follows from one training run.

:func:`train_gates` runs the ``train-gates`` instrument (:mod:`headlab.decode.gates_instrument`) through the study
runner, one unit per step: progress is a bar (``progress=True``), the run stops at ``seconds`` (a time budget) or
``steps``, and ``checkpoint=PATH.json`` is the runner's checkpoint: the finished steps (with the gates and Adam's
state of the newest two), saved every ``save_every`` steps, at the end and at Ctrl-C (which then raises
``KeyboardInterrupt``), so a later call with the same path resumes where it stopped.

    >>> import torch, random
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from headlab import kv
    >>> from headlab.decode.train import train_gates
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...     num_key_value_heads=2, intermediate_size=64)).eval()
    >>> data = [(torch.randint(0, 61, (1, 40)), torch.arange(30, 39)) for _ in range(2)]
    >>> t = train_gates(lm, data=data, rest=kv.window(2, 8), steps=3, progress=False)
    >>> t.gates.shape, t.steps, len(t.losses)
    (torch.Size([2, 2]), 3, 3)
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

import headlab.checks as checks
from headlab.attention.core import attention as _attention
from headlab.decode.heads import check_decoder, kv_layout
from headlab.decode.rules import Window
from headlab.errors import ConfigError, InputError
from headlab.progress import Progress
from headlab.results import envelope, write_json

__all__ = ["GateTrainer", "GateTraining", "gated", "per_query_head", "train_gates"]

IMPLEMENTATION = "headlab_gated"
_ACTIVE: dict[int, tuple[torch.Tensor, Window, int]] = {}  # id(attention module) -> (gates of its layer, rule, rep)


def _gated_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Registered as ``"headlab_gated"``: each query head's output mixes full and windowed attention by its
    kv head's gate (see the module docstring). ``query (B, H, n, d)``, ``key``/``value (B, Hkv, n, d)``."""
    if id(module) not in _ACTIVE:
        raise ConfigError("the 'headlab_gated' attention runs only inside headlab.decode.train.gated(...)")
    gates, rule, rep = _ACTIVE[id(module)]
    n, m = query.shape[2], key.shape[2]
    q_pos = torch.arange(m - n, m, device=query.device)[:, None]
    k_pos = torch.arange(m, device=query.device)[None, :]
    causal = k_pos <= q_pos
    if attention_mask is not None:
        own = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        causal = causal & own
    extra = {}
    if kwargs.get("softcap") is not None:
        from headlab.spec.score_mods import softcap

        extra["score_mod"] = softcap(kwargs["softcap"])
    window = causal & rule.visible(q_pos, k_pos)
    if extra:  # soft-capped scores: headlab's own attention takes them as a score_mod
        full = _attention(query, key, value, mask=causal, scale=scaling, **extra)
        win = _attention(query, key, value, mask=window, scale=scaling, **extra)
    else:  # torch's fused attention, forward and backward (no row is empty: a query always sees itself)
        gqa = query.shape[1] != key.shape[1]
        full = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=scaling, enable_gqa=gqa)
        win = F.scaled_dot_product_attention(query, key, value, attn_mask=window, scale=scaling, enable_gqa=gqa)
    a = gates.clamp(0.0, 1.0).repeat_interleave(rep).to(full.dtype)[None, :, None, None]  # (1, H, 1, 1)
    out = a * full + (1 - a) * win
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(IMPLEMENTATION, _gated_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


@contextlib.contextmanager
def gated(adapter, gates: torch.Tensor, rule: Window):
    """The model runs :func:`_gated_attention` with ``gates (layers, kv_heads)`` for the block (restored after)."""
    from headlab.models.hf.trace import implementation

    heads, kvh = adapter.layer_heads, adapter.layer_kv_heads
    for layer, am in enumerate(adapter.attn_modules):
        _ACTIVE[id(am)] = (gates[layer, : kvh[layer]], rule, heads[layer] // kvh[layer])
    try:
        with implementation(adapter.model, IMPLEMENTATION):
            yield
    finally:
        for am in adapter.attn_modules:
            _ACTIVE.pop(id(am), None)


def per_query_head(model, gates: torch.Tensor) -> torch.Tensor:
    """``(layers, heads)``: each query head takes its kv head's gate (the scores :meth:`headlab.kv.Policy.from_scores`
    ranks); columns past a layer's heads are -1."""
    heads, kvh = kv_layout(model)
    g = torch.as_tensor(gates, dtype=torch.float64)
    if g.dim() != 2 or g.shape[0] != len(heads) or g.shape[1] < max(kvh):
        raise ConfigError(
            f"gates of shape {tuple(g.shape)} do not fit this model: expected (layers, kv heads) = "
            f"({len(heads)}, {max(kvh)})"
        )
    out = torch.full((len(heads), max(heads)), -1.0, dtype=torch.float64)
    for layer, (h, n) in enumerate(zip(heads, kvh)):
        out[layer, :h] = g[layer, :n].repeat_interleave(h // n)
    return out


@dataclass
class GateTraining:
    """Trained gates ``(layers, kv_heads)`` (unclamped: ties at 0 or 1 are broken by how far past they went),
    the window they were trained against, the loss per step and how the run went."""

    gates: torch.Tensor
    rest: Window
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    stopped: str = "steps"  # "steps" or "seconds" (the time budget); "interrupt" in files of earlier versions
    settings: dict = field(default_factory=dict)
    model: str | None = None  # the model's name (a LoadedModel's, else its class)

    def to_json(self) -> dict:
        """The gates in headlab's envelope (kind ``kv_gates``; its settings: the training's and the window),
        beside the keys gate files have always had (``"kind": "headlab.kv.gates"`` among them)."""
        rest = {"sink": self.rest.sink, "recent": self.rest.recent}
        return envelope(
            "kv_gates",
            {
                "kind": "headlab.kv.gates",
                "model": self.model,
                "gates": self.gates.tolist(),
                "rest": rest,
                "losses": self.losses,
                "steps": self.steps,
                "seconds": self.seconds,
                "stopped": self.stopped,
                "settings": self.settings,
            },
            model=self.model,
            settings={**self.settings, "rest": rest},
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_json` to ``path`` (atomically, :func:`headlab.results.write_json`)."""
        return write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> GateTraining:
        """Gates saved by :meth:`save` (or ``headlab train-gates``), with the envelope or from earlier versions."""
        from headlab.reading import read_json_file

        d = read_json_file(path, what="gates saved by GateTraining.save or headlab train-gates")
        try:
            rest = Window(int(d["rest"]["sink"]), int(d["rest"]["recent"]))
            model = d.get("model") if isinstance(d.get("model"), str) else None
            return cls(
                torch.tensor(d["gates"]),
                rest,
                d.get("losses", []),
                d.get("steps", 0),
                d.get("seconds", 0.0),
                d.get("stopped", "steps"),
                d.get("settings", {}),
                model,
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"{path}: not a gate file written by GateTraining.save ({e})") from None


def _recitals(tok, n: int, tokens: int, keys: int, seed: int, far: int):
    from headlab.decode.passkey import recital

    rng = random.Random(seed)
    return [(r.ids, r.positions) for r in (recital(tok, tokens, keys, rng, far=far) for _ in range(n))]


class GateTrainer:
    """One gate training, a step at a time: the gates, Adam's state, the losses so far and the contexts.

    The ``train-gates`` instrument (``headlab train-gates`` and :func:`train_gates`) runs one step per unit of the
    study runner, which keeps each finished step's :meth:`snapshot` (JSON) and continues from it (:meth:`restore`)
    with ``--resume`` (or ``checkpoint=``). The arguments are :func:`train_gates`'s, checked the same way, before
    any step."""

    def __init__(
        self,
        model,
        *,
        rest: Window = Window(4, 256),
        data: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        contexts: int = 16,
        tokens: int = 512,
        keys: int = 4,
        steps: int = 100,
        lr: float = 0.05,
        l1: float = 0.05,
        seconds: float | None = None,
        seed: int = 0,
    ) -> None:
        from headlab.models.loaded_model import resolve

        adapter, loaded = resolve(model)
        check_decoder(adapter, getattr(loaded, "name", None) or type(adapter.model).__name__)
        rule = rest
        if getattr(rule, "kind", None) != "window" or rule.bits != 16 or rule.compensate:
            raise ConfigError(f"rest={rest!r}: gates are trained against a plain window, e.g. kv.window(4, 256)")
        for name, v in (("steps", steps), ("contexts", contexts), ("keys", keys)):
            checks.positive_int(name, v)
        if not (lr > 0 and l1 >= 0):
            raise ConfigError(f"lr={lr!r} must be > 0 and l1={l1!r} >= 0")
        if seconds is not None and not seconds > 0:
            raise ConfigError(f"seconds={seconds!r}: a time budget in seconds, > 0")
        if data is None:
            tok = getattr(loaded, "tokenizer", None)
            if tok is None:
                raise ConfigError(
                    "give data=[(ids, positions), ...], or a LoadedModel (headlab.load) whose tokenizer "
                    "builds the passkey contexts"
                )
            if tokens <= rule.sink + rule.recent:
                raise ConfigError(
                    f"tokens={tokens}: contexts no longer than the window ({rule.sink}+{rule.recent}) "
                    "evict nothing to learn from; give more tokens"
                )
            data = _recitals(tok, contexts, tokens, keys, seed, far=rule.recent)
        if not data:
            raise InputError("data is empty: give at least one (ids, positions) pair")
        self.adapter, self.rule, self.data, self.l1 = adapter, rule, data, l1
        kvh = adapter.layer_kv_heads
        self.param = torch.nn.Parameter(torch.ones(len(kvh), max(kvh)))
        self.opt = torch.optim.Adam([self.param], lr=lr)
        self.state = GateTraining(
            self.param.detach(),
            rule,
            settings={
                "lr": lr,
                "l1": l1,
                "tokens": tokens,
                "keys": keys,
                "contexts": len(data),
                "seed": seed,
                "steps": steps,
            },
            model=getattr(loaded, "name", None) or type(adapter.model).__name__,
        )
        self.targets: dict[int, torch.Tensor] = {}  # the full model's hidden states per context (computed once)

    @contextlib.contextmanager
    def frozen(self):
        """The model's weights take no gradient for the block (restored as they were after)."""
        params = list(self.adapter.model.parameters())
        before = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p, g in zip(params, before):
                p.requires_grad_(g)

    def step(self) -> float:
        """One optimiser step on the next context (inside :meth:`frozen`); returns its loss."""
        hf, st = self.adapter.model, self.state
        i = st.steps % len(self.data)
        ids, pos = self.data[i]
        if i not in self.targets:
            with torch.no_grad():
                self.targets[i] = hf.base_model(input_ids=ids).last_hidden_state[0, pos].float()  # type: ignore[operator]  # torch types module attributes Tensor | Module
        with gated(self.adapter, self.param, self.rule):
            h = hf.base_model(input_ids=ids).last_hidden_state[0, pos].float()  # type: ignore[operator]  # as above
        loss = ((h - self.targets[i]) ** 2).mean() + self.l1 * self.param.abs().mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        st.losses.append(loss.item())
        st.steps += 1
        return st.losses[-1]

    def snapshot(self) -> dict:
        """What the next step needs, as JSON (exact: float32 values survive the round trip): the gates and Adam's
        moments and step count."""
        adam = self.opt.state.get(self.param, {})
        moment = {k: adam[k].tolist() for k in ("exp_avg", "exp_avg_sq") if k in adam}
        return {
            "gates": self.param.detach().tolist(),
            "adam_step": float(adam["step"]) if "step" in adam else 0.0,
            **moment,
        }

    def restore(self, snap: dict, *, steps: int, losses: Sequence[float] = (), seconds: float = 0.0) -> None:
        """Continue from a :meth:`snapshot` taken after ``steps`` steps (``losses``: theirs, if known)."""
        with torch.no_grad():
            self.param.copy_(torch.tensor(snap["gates"], dtype=self.param.dtype))
        self.opt.state.clear()
        if "exp_avg" in snap:
            self.opt.state[self.param] = {
                "step": torch.tensor(float(snap["adam_step"]), dtype=torch.float32),
                "exp_avg": torch.tensor(snap["exp_avg"], dtype=self.param.dtype),
                "exp_avg_sq": torch.tensor(snap["exp_avg_sq"], dtype=self.param.dtype),
            }
        self.state.steps, self.state.losses, self.state.seconds = steps, list(losses), seconds

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Continue from a checkpoint file of :func:`train_gates` (``checkpoint=``, a ``torch.save`` file); one
        written with other settings is refused."""
        ck, rule, state = Path(path), self.rule, self.state
        saved = torch.load(ck, weights_only=False)
        same = {k: v for k, v in saved.get("settings", {}).items() if k != "steps"}
        if same != {k: v for k, v in state.settings.items() if k != "steps"} or list(saved.get("rest", ())) != [
            rule.sink,
            rule.recent,
        ]:
            raise ConfigError(
                f"{ck} holds a run with other settings ({saved.get('settings')}, rest "
                f"{saved.get('rest')}); give the same settings to resume it, or another checkpoint path"
            )
        self.param.data.copy_(saved["gates"])
        self.opt.load_state_dict(saved["optim"])
        state.losses, state.steps, state.seconds = saved["losses"], saved["steps"], saved["seconds"]


def train_gates(
    model,
    *,
    rest: Window = Window(4, 256),
    data: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    contexts: int = 16,
    tokens: int = 512,
    keys: int = 4,
    steps: int = 100,
    lr: float = 0.05,
    l1: float = 0.05,
    seconds: float | None = None,
    seed: int = 0,
    checkpoint: str | os.PathLike | None = None,
    save_every: int = 10,
    progress: bool | Progress = True,
) -> GateTraining:
    """Train one gate per kv head (DuoAttention): see the module docstring.

    Args:
        model: a causal LM (LoadedModel, Hugging Face model or adapter); its weights are not changed.
        rest: the window the gates choose against (``kv.window(4, 256)``).
        data: ``[(ids (1, n), positions)]`` to train on; default ``contexts`` recitals of ``tokens`` tokens with
            ``keys`` keys each, drawn with ``seed`` from headlab's own filler (needs the model's tokenizer).
        steps: optimiser steps (one context each, cycling through the data); ``seconds``: stop earlier when
            the run has taken that long.
        lr, l1: Adam's learning rate and the weight of the L1 term on the gates. (The defaults are those of
            the SmolLM2-135M run in ``benchmarks/bench_kv_train.py``, sized for a CPU: 50 steps took 32 minutes.)
        checkpoint: a ``.json`` file that keeps the finished steps (every ``save_every`` steps, at the end and at
            Ctrl-C), resumed from when it exists: ``headlab train-gates``' ``--out`` file, which the command
            continues with ``--resume``; one written with other settings is refused (more ``steps`` go on from it).
        progress: a display (True), nothing (False), or ``progress(stage, done, total)`` (headlab's protocol;
            the losses are on the result).

    Runs the ``train-gates`` instrument through the study runner (:func:`headlab.interpret.study.runner.call`):
    Ctrl-C raises ``KeyboardInterrupt`` once the checkpoint, if any, keeps the finished steps.
    """
    from headlab.interpret.study import runner

    ck = None if checkpoint is None else Path(checkpoint).expanduser()
    if ck is not None and ck.suffix.lower() != ".json":
        raise ConfigError(
            f"checkpoint={str(checkpoint)!r}: the checkpoint is the run's JSON file (its finished steps, read back by "
            "the next call with the same path); give a path ending in .json"
        )
    options = {
        "model": model,
        "rest": rest,
        "window": f"{rest.sink},{rest.recent}" if isinstance(rest, Window) else "4,256",
        "data": data,
        "contexts": contexts,
        "tokens": tokens,
        "keys": keys,
        "steps": steps,
        "lr": lr,
        "l1": l1,
        "seconds": seconds,
        "seed": seed,
        "out": ck,
        "save_every": save_every,
    }
    return runner.call("train-gates", options, progress=progress, resume=ck is not None and ck.is_file())
