"""Fine-tuned wrappers: a PEFT LoRA model read through its base model's structure, the adapter's deltas included.

A LoRA layer (``peft``'s ``lora.Linear``) wraps a projection ``W`` (an ``nn.Linear`` or GPT-2's ``Conv1D``) and adds
``scale * B @ A`` to it, ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), transposed when
``fan_in_fan_out`` (a ``Conv1D``). headlab adapts such a model as it adapts its base model (the declared family, or
the structure found with every LoRA layer replaced by the layer it wraps) and reads every per-head weight, W_Q,
W_K, W_V and W^O, from the effective weight ``W + sum over active adapters of scale * B @ A``, so the norms, the
OV/QK circuits, the atlas and everything else that reads weights see what the model computes. Gates, captures and
backends act on the wrapped modules (a gate multiplies z before both W and the LoRA branch of W^O).

Where the LoRA branch is not merged, ``W_Q(l)`` and the others are copies, not views: editing them does not edit the
model (merge first for views: ``peft_model.merge_and_unload()``). Pruning refuses: merge first.

Refused (:class:`~headlab.errors.UnsupportedArchitectureError`, saying to merge): other PEFT methods (prompt
learning, IA3, LoHa, ...), LoRA variants (DoRA), ``lora_bias``, LoRA on the embeddings or the LM head (read as
weights by the logit lens and the atlas), trained copies (``modules_to_save``) inside the attention.

The load-time check (:mod:`headlab.models.hf.verify`, all six checks) runs on the model with each LoRA layer
standing in as one linear map of its effective weight (nothing is copied but those weights; the model's own
tensors are put back as they were), after a seventh check, ``lora``: the model's output through PEFT's own LoRA
forward equals its output through the effective weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headlab.errors import ModelError, PruneError, UnsupportedArchitectureError
from headlab.models.hf.trace import is_linear

MERGE = "merge the adapter into the model first (peft_model.merge_and_unload()) and adapt the merged model"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def _peft_loaded() -> bool:
    """PEFT objects exist only once ``peft`` is imported: until then nothing here needs looking at."""
    return "peft" in sys.modules


def unwrap(model: Any) -> tuple[Any, Any]:
    """``(the transformers model, the PeftModel or None)`` of a ``PeftModel``, its ``LoraModel`` or a plain model."""
    if not _peft_loaded():
        return model, None
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    if isinstance(model, PeftModel):
        return model.get_base_model(), model
    return (model.model if isinstance(model, BaseTuner) else model), None


def tuner_layers(model: nn.Module) -> list[tuple[str, Any]]:
    """``(path, module)`` of every PEFT tuner layer (LoRA or another method) inside ``model``."""
    if not _peft_loaded():
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def _active(m) -> list[str]:
    return [a for a in m.active_adapters if a in m.lora_A]


def _delta(m, name: str, dtype: torch.dtype) -> torch.Tensor:
    """``scale * B @ A`` of adapter ``name``, as the wrapped weight is laid out (transposed for ``Conv1D``)."""
    A, B = m.lora_A[name].weight, m.lora_B[name].weight  # (r, in), (out, r)
    d = (B.float() @ A.float()) * m.scaling[name]  # (out, in)
    return (d.T if m.fan_in_fan_out else d).to(dtype)


def effective_weight(m) -> torch.Tensor:
    """The weight LoRA layer ``m`` computes with: its base weight plus the delta of every active, unmerged adapter
    (minus the merged ones when its adapters are disabled: PEFT's forward unmerges them then)."""
    w = m.get_base_layer().weight
    if m.disable_adapters:
        for name in m.merged_adapters:
            w = w - _delta(m, name, w.dtype)
        return w
    if m.merged:
        return w
    for name in _active(m):
        w = w + _delta(m, name, w.dtype)
    return w


@contextlib.contextmanager
def merged(layers) -> Any:
    """Inside the block each LoRA layer in ``layers`` computes ``x @ W_eff`` through its base layer alone, whose
    weight is the effective weight (a new tensor; with gradients, a function of A and B). The model's own tensors
    and merge state are put back exactly as they were (no add-and-subtract rounding)."""
    saved = []
    try:
        for m in layers:
            if m.merged and not m.disable_adapters:
                continue  # its base weight is the effective weight already
            w = effective_weight(m)
            base = m.get_base_layer()
            saved.append((m, base, base._parameters["weight"], list(m.merged_adapters)))
            base._parameters["weight"] = w  # a plain tensor stands in for the parameter (restored below)
            m.merged_adapters = [] if m.disable_adapters else _active(m)  # the forward then calls the base alone
        yield
    finally:
        for m, base, w0, names in reversed(saved):
            base._parameters["weight"] = w0
            m.merged_adapters = names


@contextlib.contextmanager
def base_view(model: nn.Module, layers) -> Any:
    """Inside the block every LoRA layer is replaced, in its parent, by the layer it wraps: the base model's module
    tree (what structure discovery reads), restored after."""
    swapped = []
    try:
        for path, m in layers:
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            parent._modules[name] = m.get_base_layer()
            swapped.append((parent, name, m))
        yield
    finally:
        for parent, name, m in reversed(swapped):
            parent._modules[name] = m


def check_method(peft_model) -> None:
    """Refuse a ``PeftModel`` whose active adapters are not LoRA (prompt learning, IA3, LoHa, ...)."""
    for name in peft_model.active_adapters:
        cfg = peft_model.peft_config[name]
        kind = str(getattr(cfg.peft_type, "value", cfg.peft_type))
        if kind != "LORA" or getattr(cfg, "is_prompt_learning", False):
            raise UnsupportedArchitectureError(
                f"the PEFT adapter {name!r} is {kind}, not LoRA: headlab reads LoRA's weights only; {MERGE} "
                "(where the method merges)"
            )


def check_supported(model: nn.Module, layers) -> None:
    """Refuse, saying what to do, what headlab cannot read as base + scale * B @ A (see the module docstring)."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.utils.other import AuxiliaryTrainingWrapper

    heads: set[int] = set()
    for f in ("get_input_embeddings", "get_output_embeddings"):
        with contextlib.suppress(NotImplementedError, AttributeError):  # a model without one
            heads.add(id(getattr(model, f)()))
    for path, m in layers:
        if type(m) is not LoraLinear or not is_linear(m.get_base_layer()):
            raise UnsupportedArchitectureError(
                f"{path} is a PEFT {type(m).__name__} around a {type(m.get_base_layer()).__name__}: headlab reads LoRA "
                f"on nn.Linear and Conv1D layers only; {MERGE}"
            )
        if id(m) in heads:
            raise UnsupportedArchitectureError(
                f"{path} carries LoRA on the embeddings or the LM head, which the logit lens and the atlas read as "
                f"weights; {MERGE}"
            )
        for name in _active(m):
            if name in m.lora_variant:
                raise UnsupportedArchitectureError(
                    f"{path}: adapter {name!r} is a LoRA variant ({type(m.lora_variant[name]).__name__}, e.g. DoRA), "
                    f"not base + scale * B @ A; {MERGE}"
                )
            if m.lora_B[name].bias is not None:
                raise UnsupportedArchitectureError(f"{path}: adapter {name!r} trains a bias (lora_bias); {MERGE}")
    for n, m in model.named_modules():
        if isinstance(m, AuxiliaryTrainingWrapper) and id(m) in heads:
            raise UnsupportedArchitectureError(
                f"{n} is a PEFT {type(m).__name__} (a trained copy) of the embeddings or the LM head, which the logit "
                f"lens and the atlas read as weights; {MERGE}"
            )


def _check_attention(adapter) -> None:
    """Refuse a trained copy (``modules_to_save``) inside an attention layer: its weights are not the ones read."""
    from peft.utils.other import AuxiliaryTrainingWrapper

    for l, (am, op) in enumerate(zip(adapter.attn_modules, adapter.out_projs)):
        for m in (*am.modules(), *op.modules()):
            if isinstance(m, AuxiliaryTrainingWrapper):
                raise UnsupportedArchitectureError(
                    f"attention layer {l} holds a PEFT {type(m).__name__} (a trained copy of a module, "
                    f"modules_to_save), whose weights headlab does not read; {MERGE}"
                )


class LoraMixin:
    """Effective weights on top of a family's (or a structure's) adapter class, placed first in the MRO."""

    lora: bool = True
    peft: Any = None  # the PeftModel, when the model came wrapped in one
    verdict: Any = None  # the load-time check's Verdict (None when adapted with check=False)
    _lora_layers: list  # per layer: the LoRA layers its W_Q, W_K, W_V and W^O may be read from

    def _weights(self, layer, which):
        op = self.out_projs[layer]  # type: ignore[attr-defined]  # the adapter's W^O modules
        mine = [m for m in self._lora_layers[layer] if (m is op) == (which == "o")]  # W^O's LoRA, or the others
        with merged(mine):
            return super()._weights(layer, which)  # type: ignore[misc]  # a family's accessor, next in the MRO

    def cut_heads(self, attn, out, q_heads, kv_heads, H, Hkv) -> None:
        raise PruneError(f"the model carries PEFT LoRA layers: headlab does not cut them; {MERGE}, then prune it")

    @contextlib.contextmanager
    def checked_view(self, x: dict, verdict):
        """What :func:`~headlab.models.hf.verify.verify` checks a LoRA model on: first the ``lora`` check (PEFT's
        own forward against the effective weights), then the six checks with every LoRA layer merged as one
        linear map (so a zeroed W^O block zeroes its LoRA branch too)."""
        from headlab.models.hf.verdict import Check

        every = [m for ms in self._lora_layers for m in ms]
        main = lambda out: out.logits if getattr(out, "logits", None) is not None else out[0]
        with torch.no_grad():
            own = main(self.model(**x)).double()  # type: ignore[attr-defined]  # the adapter's model
            with merged(every):
                eff = main(self.model(**x)).double()  # type: ignore[attr-defined]
        p = next(self.model.parameters())  # type: ignore[attr-defined]
        tol = 1e-4 if p.dtype in (torch.float32, torch.float64) else 2e-2
        worst = float((own - eff).abs().max() / max(1.0, float(eff.abs().max())))
        what = f"PEFT's forward of {len(every)} LoRA layers against the model on their effective weights"
        verdict.checks.append(Check("lora", worst <= tol, worst, tol, what + " (base + scale * B @ A)"))
        with merged(every):
            yield

    def close(self) -> None:
        super().close()  # type: ignore[misc]
        if self.peft is not None and self.peft.__dict__.get("_headlab_adapter") is self:
            del self.peft._headlab_adapter


def adapt_lora(model: nn.Module, *, check: bool = True):
    """The adapter of a PEFT LoRA model (a ``PeftModel``, or a model with LoRA layers injected), or None when
    ``model`` has none. A cached adapter is reused only while its LoRA layers are still the model's (one left by a
    base adapter, or by a LoRA adapter after ``merge_and_unload()``, is closed: its hooks sat on replaced modules)."""
    inner, peft_model = unwrap(model)
    layers = tuner_layers(inner)
    cached = inner.__dict__.get("_headlab_adapter")
    if cached is not None and getattr(cached, "lora", False) != bool(layers):
        cached.close()  # stale: built before the LoRA layers were injected, or after they were merged away
        cached = None
    if peft_model is not None:
        check_method(peft_model)
        if not layers:
            raise UnsupportedArchitectureError(
                "the PeftModel holds no LoRA layer; adapt the model it wraps (peft_model.get_base_model())"
            )
    if not layers:
        return None
    if cached is not None and [id(m) for m in cached._lora_ids] == [id(m) for _, m in layers]:
        return cached
    if cached is not None:
        cached.close()
    check_supported(inner, layers)
    cls = _base_class(inner, layers)
    sub = type(f"Lora{cls.__name__}", (LoraMixin, cls), {"__module__": __name__})
    adapter = sub(inner)
    try:
        _check_attention(adapter)
    except UnsupportedArchitectureError:
        adapter.close()
        raise
    adapter.peft = peft_model
    adapter._lora_ids = [m for _, m in layers]
    ids = {id(m) for _, m in layers}
    adapter._lora_layers = [
        list({id(m): m for m in (*am.modules(), op) if id(m) in ids}.values())
        for am, op in zip(adapter.attn_modules, adapter.out_projs)
    ]
    adapter.verdict = None
    if check:
        from headlab.models.hf.verify import verify

        verdict = adapter.verdict = verify(adapter, cache=False)  # not cached: it holds these LoRA weights
        if not verdict.passed:
            adapter.close()
            c = verdict.failed
            assert c is not None  # a verdict that did not pass names its failed check
            raise UnsupportedArchitectureError(
                f"the LoRA model on {adapter.family!r} failed the load-time check {c.name!r} ({c.detail}; worst "
                f"difference {c.worst:.3g}, tolerance {c.tol:.0e}); {MERGE}"
            )
    inner._headlab_adapter = adapter  # type: ignore[assignment]  # torch types module attributes Tensor | Module
    if peft_model is not None:
        peft_model.__dict__["_headlab_adapter"] = adapter  # on the wrapper itself (its getattr reads the inner model)
    return adapter


def _base_class(inner: nn.Module, layers):
    """The adapter class of the base model: its declared family, else the structure found on the module tree with
    every LoRA layer replaced by the layer it wraps."""
    from headlab.models.hf.registry import REFUSED, adapter_class, unsupported_message

    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type is None:
        raise UnsupportedArchitectureError(
            f"LoRA layers in a {type(inner).__name__}, which is not a Hugging Face transformers model; {MERGE}"
        )
    if model_type in REFUSED:
        raise UnsupportedArchitectureError(unsupported_message(model_type))
    cls = adapter_class(model_type)
    if cls is not None:
        return cls
    from headlab.models.hf.structure import adapter_class_for

    with base_view(inner, layers):
        return adapter_class_for(inner)[0]


def adapter_base(folder: Path) -> tuple[str, list[Path]]:
    """The base model a PEFT adapter folder names (``base_model_name_or_path`` in ``adapter_config.json``) and the
    folders it may be: as written (absolute, or from the working folder), then relative to the adapter folder (the
    loader then tries it as a headlab known name). :class:`~headlab.errors.ModelError` when there is no such name,
    no adapter weights, or no ``peft`` to read them."""
    try:
        import peft  # noqa: F401  (the loader's next step needs it)
    except ImportError:
        raise ModelError(
            f"{folder} is a PEFT adapter folder (adapter_config.json); reading it needs peft: pip install "
            "'headlab[peft]'"
        ) from None
    if not any((folder / f).is_file() for f in ADAPTER_WEIGHTS):
        raise ModelError(f"{folder} has an adapter_config.json but no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{folder}/adapter_config.json is not readable JSON ({e})") from None
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    if not isinstance(base, str) or not base.strip():
        raise ModelError(f"{folder}/adapter_config.json names no base model (base_model_name_or_path)")
    return base, [Path(base).expanduser(), folder / base]


def missing_base(folder: Path, base: str) -> str:
    return (
        f"{folder} is a PEFT adapter whose base model {base!r} is neither a local model folder nor a known name; "
        "nothing is downloaded: put the base model's folder there, or set base_model_name_or_path in "
        "adapter_config.json to its path"
    )


def wrap_adapter(base_model: nn.Module, folder: Path, *, check: bool):
    """The adapter of ``base_model`` (its headlab adapter closed first) with the LoRA of ``folder`` loaded into it."""
    from peft import PeftModel

    adapter = base_model.__dict__.get("_headlab_adapter")
    if adapter is not None:
        adapter.close()  # its hooks sit on modules LoRA is about to wrap
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        pm = PeftModel.from_pretrained(base_model, str(folder), is_trainable=False)
    except Exception as e:  # noqa: BLE001  (peft raises many kinds here: said as a ModelError)
        raise ModelError(f"could not load the PEFT adapter in {folder}: {e}") from None
    lora = adapt_lora(pm.eval(), check=check)
    if lora is None:  # pragma: no cover - adapt_lora refuses a PeftModel without LoRA layers itself
        raise ModelError(f"the PEFT adapter in {folder} put no LoRA layer into the model")
    return lora


__all__ = [
    "adapt_lora",
    "base_view",
    "check_method",
    "check_supported",
    "effective_weight",
    "adapter_base",
    "missing_base",
    "wrap_adapter",
    "merged",
]
