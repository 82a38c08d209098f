"""The seams structure is read through: a tracing attention implementation and module recordings.

:func:`trace` runs a model once with ``"headlab_trace"`` registered in transformers' attention interface and
returns every attention call (module, q, k, v, output, keyword names); :func:`recording` keeps each named
module's input and output; :func:`close` and :func:`continues_from` compare what was recorded. Used by
:mod:`headlab.models.hf.structure` (discovery) and :mod:`headlab.models.hf.verify` (the load-time check).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from headlab.errors import UnsupportedArchitectureError

TRACE = "headlab_trace"
ATOL = 1e-5

_RECORD: list | None = None  # the calls of the running trace (None: no trace is running)


def _trace_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """The tracing attention function: plain softmax attention in float32 (what eager computes), recording
    each call. Returns ``(out (B, Lq, H, d), weights)`` like every attention function."""
    B, H, Lq, d = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    k = key.repeat_interleave(H // Hkv, 1) if Hkv != H and H % Hkv == 0 else key
    v = value.repeat_interleave(H // Hkv, 1) if Hkv != H and H % Hkv == 0 else value
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    s = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    cap = kwargs.get("softcap")
    if cap:
        s = torch.tanh(s / cap) * cap
    bias = kwargs.get("position_bias")
    if bias is not None:
        s = s + bias.float()
    if attention_mask is not None:
        m = attention_mask[..., :Lk]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    elif (is_causal if is_causal is not None else getattr(module, "is_causal", False)) and Lq > 1:
        tri = torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).tril(Lk - Lq)
        s = s.masked_fill(~tri, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0).to(value.dtype)
    out = torch.matmul(p, v.to(p.dtype))  # (B, H, Lq, dv)
    if _RECORD is not None:
        biased = (
            attention_mask is not None
            and attention_mask.is_floating_point()
            and bool(((attention_mask != 0) & (attention_mask > torch.finfo(attention_mask.dtype).min / 2)).any())
        )
        _RECORD.append(
            Call(
                module,
                query.detach(),
                key.detach(),
                value.detach(),
                out.detach(),
                sorted(kwargs) + (["mask_bias"] if biased else []),
            )
        )
    return out.transpose(1, 2).contiguous(), p


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TRACE, _trace_attention)
    AttentionMaskInterface.register(TRACE, sdpa_mask)


_register()


@dataclass
class Call:
    module: nn.Module
    q: torch.Tensor  # (B, H, Lq, d)
    k: torch.Tensor  # (B, Hkv, Lk, d)
    v: torch.Tensor  # (B, Hkv, Lk, dv)
    out: torch.Tensor  # (B, H, Lq, dv)
    kwargs: list[str]


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, tuple | list):
        return next((t for t in x if isinstance(t, torch.Tensor)), None)
    if isinstance(x, dict):
        return next((t for t in x.values() if isinstance(t, torch.Tensor)), None)
    return getattr(x, "last_hidden_state", None)


@contextlib.contextmanager
def implementation(model: Any, name: str):  # a transformers model
    """The model on attention implementation ``name`` for the block (restored after). A model whose modules compute
    attention with their own math switches its bridge (:mod:`headlab.models.hf.own_bridge`) instead."""
    from headlab.models.hf.own_state import bridge_of, set_implementation

    if bridge_of(model) is not None:
        before = set_implementation(model, name)
        try:
            yield
        finally:
            set_implementation(model, before or "eager")
        return
    saved = model.config._attn_implementation
    if saved != name:
        _quietly(model.set_attn_implementation, name)  # a pinned class only logs that it stays on eager
    try:
        yield
    finally:
        if model.config._attn_implementation != saved:
            model.set_attn_implementation(saved)


def _quietly(fn, *args) -> None:
    from transformers.utils import logging

    before = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        fn(*args)
    finally:
        logging.set_verbosity(before)


def trace(model: nn.Module, inputs: dict) -> list[Call]:
    """The attention calls of one forward of ``model`` on ``inputs`` (no gradients); a bridged model's modules that
    compute attention with their own math call it through the bridge (:mod:`headlab.models.hf.own_bridge`)."""
    global _RECORD
    calls: list[Call] = []
    _RECORD = calls
    try:
        with torch.no_grad(), implementation(model, TRACE):
            model(**inputs)
    finally:
        _RECORD = None
    return calls


@contextlib.contextmanager
def recording(modules: dict[str, nn.Module]):
    """Record every named module's input (its first tensor argument, or ``hidden_states``) and output tensor
    during the block: ``rec[name] = (input, output)``."""
    rec: dict[str, tuple] = {}
    handles = []
    for name, m in modules.items():

        def hook(mod, args, kwargs, out, name=name):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            y = _first_tensor(out)  # copies: a block may add into a module's output in place (Falcon's MLP)
            rec.setdefault(
                name,
                (
                    x.detach().clone() if isinstance(x, torch.Tensor) else None,
                    None if y is None else y.detach().clone(),
                ),
            )

        handles.append(m.register_forward_hook(hook, with_kwargs=True))
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()


def close(a: torch.Tensor | None, b: torch.Tensor | None, atol: float = ATOL) -> bool:
    """Equal to ``atol`` relative to the larger magnitude (float64), as tensors of the same size and last axis."""
    if a is None or b is None or a.numel() != b.numel() or a.shape[-1] != b.shape[-1]:
        return False
    a, b = a.double().reshape(b.shape), b.double()  # (B, L, E) against OPT's flattened (B * L, E)
    scale = max(1.0, float(b.abs().max()), float(a.abs().max()))
    return bool(((a - b).abs().max() <= atol * scale).item()) if a.numel() else True


def is_linear(m: nn.Module) -> bool:
    """An ``nn.Linear`` or GPT-2's ``Conv1D`` (a 2-D weight applied to the last axis)."""
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D"


def out_features(m: Any) -> int:  # a Linear or transformers' Conv1D
    return int(m.weight.shape[1] if is_conv1d(m) else m.weight.shape[0])


def in_features(m: Any) -> int:  # as out_features
    return int(m.weight.shape[0] if is_conv1d(m) else m.weight.shape[1])


def is_norm(m: nn.Module) -> bool:
    return "norm" in type(m).__name__.lower() and not isinstance(m, nn.modules.batchnorm._BatchNorm)


def refuse(model_type: str, why: str) -> UnsupportedArchitectureError:
    from headlab.models.hf.registry import ADDING_A_FAMILY

    return UnsupportedArchitectureError(
        f"no headlab adapter for {model_type!r}: {why}; to declare what structure cannot show see {ADDING_A_FAMILY}"
    )


def continues_from(s: torch.Tensor, rec: dict, *, skip=lambda name: False, atol: float = ATOL) -> bool:
    """Does the stream go on from ``s``: is some norm's input or the block's output (``rec[""]``) equal to
    ``s + m`` for some recorded module output ``m`` (the next sublayer's residual add), or to ``s`` itself?
    ``rec[name] = (input, output)``; ``skip(name)`` leaves modules out as ``m``."""
    targets = [t for n, (t, _) in rec.items() if n.endswith(_NORM_MARK) and t is not None]
    block_out = rec.get("", (None, None))[1]
    if block_out is not None:
        targets.append(block_out)
    outs = [out for n, (_, out) in rec.items() if n and not skip(n) and out is not None and out.numel() == s.numel()]
    for t in targets:
        if t.numel() != s.numel() or t.shape[-1] != s.shape[-1]:
            continue
        if close(t, s, atol):
            return True
        d = t.reshape(s.shape) - s
        if any(close(d, m, atol) for m in outs):
            return True
    return False


_NORM_MARK = "\x00norm"  # a key suffix: marks a norm's record for continues_from


def mark_norms(rec: dict, named: dict) -> dict:
    """``rec`` with every norm's entry also under ``name + _NORM_MARK`` (what :func:`continues_from` reads)."""
    out = dict(rec)
    for n, m in named.items():
        if n and is_norm(m) and n in rec:
            out[n + _NORM_MARK] = rec[n]
    return out


__all__ = [
    "ATOL",
    "TRACE",
    "close",
    "continues_from",
    "implementation",
    "is_linear",
    "mark_norms",
    "recording",
    "refuse",
    "trace",
]
