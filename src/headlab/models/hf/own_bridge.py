"""The bridge: modules that compute attention with their own math, served through the attention interface.

:func:`bridge` runs the model once under a discovery :class:`~headlab.models.hf.own_math.Interceptor` that
follows every module's math, finds the modules whose forward computes ``softmax(q k^T c + mask) v`` (or calls
``scaled_dot_product_attention``) and installs two hooks on each: while the model runs on one of headlab's
implementations (``"headlab"``, or the discovery trace), the module's forward runs under an interceptor that
hands its attention to that implementation as transformers' own modules do; on any other implementation (the
model's own eager path, the yardstick) the hooks do nothing.

The implementation is the bridge's own (:func:`set_implementation`), not ``config._attn_implementation``: a
model that computes attention itself is pinned to its eager path by transformers, and its masks must stay the
additive ones its own math expects. Grouped-query heads a module repeats before its math (``repeat_kv``) are
found on the discovery run (the keys and values of ``r`` consecutive heads are equal) and handed to the
implementation unrepeated, so ``W_K`` and ``W_V`` are the projections' own. A module whose math headlab cannot
express (soft-capping, a clamp, a score read twice) is refused naming the op, at discovery; at run time it is an
error, never a layer silently left out of a capture or a gate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headlab.errors import UnsupportedArchitectureError
from headlab.models.hf.own_math import Interceptor
from headlab.models.hf.own_state import SERVED, Bridge, bridge_of, set_implementation
from headlab.models.hf.trace import implementation, is_linear, refuse


def _attend(module: nn.Module, impl: str, r: int, need: bool):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fn = ALL_ATTENTION_FUNCTIONS[impl]

    def attend(q, k, v, mask, *, scaling, dropout, is_causal):
        if r > 1:
            k, v = k[:, ::r], v[:, ::r]
        kw = {"output_attentions": True} if need else {}
        out, w = fn(module, q, k, v, mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kw)
        return out.transpose(1, 2), w

    return attend


def _pre(module: nn.Module, args, kwargs):
    b: Bridge | None = getattr(module, "_headlab_own", None)
    if b is None or b.impl is None:
        return None
    need = bool(kwargs.get("output_attentions", False))
    mode = Interceptor(
        _attend(module, b.impl, getattr(module, "_headlab_kv_repeat", 1), need),
        defer=True,
        training=module.training,
        heads=getattr(module, "_headlab_heads", None),
    )
    mode.need = need
    mode.__enter__()
    module.__dict__.setdefault("_headlab_modes", []).append(mode)
    return None


def _post(module: nn.Module, args, kwargs, output):
    modes = module.__dict__.get("_headlab_modes")
    if not modes:
        return None
    mode = modes.pop()
    mode.__exit__(None, None, None)
    if mode.unserved:  # part of its attention ran outside the call: a capture or a gate would miss it
        raise UnsupportedArchitectureError(
            f"{type(module).__name__} computed its attention with an op headlab cannot follow ({mode.unserved}) on "
            "this call, so headlab's backends, gates and captures cannot serve it; run the model on its own "
            "(eager) attention"
        )
    for k, v in list(vars(module).items()):  # weights the module kept on itself (for a later look)
        if isinstance(v, torch.Tensor) and mode.chain(v) is not None:
            setattr(module, k, _real_outputs(mode, v, keep=True))
    return _real_outputs(mode, output)


def _real_outputs(mode: Interceptor, out, *, keep: bool = False):
    """``out`` with every placeholder the module returns made real. The attention weights a module returns come
    from the attention call when the caller asked for them (``output_attentions``); otherwise they are None, as
    transformers' SDPA modules return (made real they would cost the n x n map the call avoided). ``keep``: made
    real whatever was asked (weights a module keeps on itself)."""
    if isinstance(out, torch.Tensor):
        c = mode.chain(out)
        if c is None:
            return out
        if c.weights and c.result is not None:
            return c.result.to(out.dtype)
        if c.weights and not keep and not mode.need:
            return None
        return mode.real(out)
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return tuple(_real_outputs(mode, o, keep=keep) for o in out)
    if isinstance(out, list):
        return [_real_outputs(mode, o, keep=keep) for o in out]
    return out


def _repeat(k: torch.Tensor, v: torch.Tensor) -> int:
    """The largest ``r`` such that each group of ``r`` consecutive heads of ``k`` and ``v`` is one head repeated."""
    H = k.shape[1]
    for r in range(H, 1, -1):
        if H % r:
            continue
        if all(torch.equal(t, t[:, ::r].repeat_interleave(r, 1)) for t in (k, v)):
            return r
    return 1


def _projection(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() >= 2 and not isinstance(m, nn.Embedding)


def _owner(module_ids: dict[int, str], stack: list[nn.Module], linear_ids: set[int]) -> nn.Module | None:
    """The innermost running module that holds a linear map (the attention module, not a helper inside it)."""
    for m in reversed(stack):
        if id(m) in linear_ids and id(m) in module_ids:
            return m
    return stack[-1] if stack else None


def discover_own(model: nn.Module, inputs: dict) -> tuple[list[dict], list[tuple[Any, str]]]:
    """One forward of ``model`` (its own math) under a discovery interceptor: the attentions found (each with the
    module that computes it) and the ops that read attention scores in a way headlab cannot express."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    paths = {id(m): p for p, m in model.named_modules()}
    # modules holding a projection: a linear map, or any 2-D-or-more weight (IBert's QuantLinear, a 1x1 Conv1d), so
    # that the attention module, not the model's root, is named when its projections are not nn.Linear
    linear_ids = {id(m) for m in model.modules() if any(is_linear(c) or _projection(c) for c in m.modules())}
    stack: list[nn.Module] = []

    def push(m, args):
        stack.append(m)

    def pop(m, args, out):
        if stack and stack[-1] is m:
            stack.pop()

    spy = Interceptor(here=lambda: _owner(paths, stack, linear_ids))
    h1, h2 = register_module_forward_pre_hook(push), register_module_forward_hook(pop, always_call=True)
    try:
        with torch.no_grad(), spy:
            model(**inputs)
    finally:
        h1.remove()
        h2.remove()
    return spy.events, spy.breaks


def bridge(model: nn.Module, inputs: dict, model_type: str) -> Bridge | None:
    """Find the modules of ``model`` that compute attention with their own math and install the bridge on them
    (see the module docstring). None when no module does; refuses (typed) a module whose math headlab cannot
    follow, naming the op."""
    b = bridge_of(model)
    if b is not None:
        return b
    events, breaks = discover_own(model, inputs)
    paths = {id(m): p for p, m in model.named_modules()}
    found = [e for e in events if e.get("module") is not None]
    mods = {id(e["module"]): e["module"] for e in found}
    broken = [(m, why) for m, why in breaks if m is not None and id(m) not in mods]
    if broken:
        m, why = broken[0]
        raise refuse(
            model_type,
            f"its attention module {paths.get(id(m), type(m).__name__)!r} computes attention itself, with {why}, "
            "which headlab cannot express as one attention call (scale, mask, additive bias, softmax); a family "
            "class with its own attention forward is needed",
        )
    if not found:
        return None
    b = Bridge()
    for e in found:
        m = e["module"]
        path = paths[id(m)]
        if path in b.kinds:
            continue
        b.modules.append(path)
        b.kinds[path] = e["kind"]
        k, v = e["tensors"]
        m._headlab_heads = e["q"][1]
        if e["q"][1] == k.shape[1] == v.shape[1] and k.dim() == 4:
            r = _repeat(k, v)
            if r > 1:
                b.repeats[path] = r
                m._headlab_kv_repeat = r
        if e.get("causal") and not hasattr(m, "is_causal"):
            m.is_causal = True
        m._headlab_own = b
        m.register_forward_pre_hook(_pre, with_kwargs=True)
        m.register_forward_hook(_post, with_kwargs=True, always_call=True)
    setattr(model, "_headlab_own", b)  # noqa: B010  (nn.Module types its attributes as tensors or modules)
    return b


def rebuilt(adapter: Any, x: dict, got: dict, tol: float) -> tuple[bool, float, float, str]:
    """The pattern check of a model that cannot return its attention weights (no ``output_attentions``): each
    layer's per-head outputs rebuilt from the captured weights and values, ``sum_k P[h, q, k] v[h, k]``, against
    the input of its output projection on the model's own (eager) run. ``(passed, worst, tol, where)``."""
    model = adapter.model
    seen: dict[int, torch.Tensor] = {}
    handles = [
        proj.register_forward_pre_hook(lambda m, a, l=l: seen.setdefault(l, a[0].detach()))
        for l, proj in enumerate(adapter.out_projs)
    ]
    try:
        with torch.no_grad(), implementation(model, "eager"):
            model(**x)
    finally:
        for h in handles:
            h.remove()
    worst, where = 0.0, "sum_k P v rebuilt from the captured weights and values against W^O's input (eager)"
    for l in range(adapter.n_layers):
        p, v = got.get(adapter.site_name(l, "pattern")), got.get(adapter.site_name(l, "v"))
        if p is None or v is None or l not in seen:
            return False, float("inf"), tol, f"layer {l}: the pattern, the values or W^O's input was not seen"
        v = v.repeat_interleave(p.shape[1] // v.shape[1], 1)
        z = (p.double() @ v.double()).transpose(1, 2).reshape(seen[l].shape)
        w = float((z - seen[l].double()).abs().max()) if z.numel() else 0.0
        if w > worst:
            worst, where = w, f"worst at layer {l}: sum_k P v against W^O's input (eager)"
    return worst <= tol, worst, tol, where


__all__ = ["Bridge", "bridge", "bridge_of", "discover_own", "rebuilt", "set_implementation", "SERVED"]
