"""Attention a module computes with its own math, read as one attention call: :class:`Interceptor`.

Many attention modules never call transformers' attention interface: GPT-Neo, XGLM, remote-code decoders
(InternLM2's packed ``wqkv``, Baichuan's ``W_pack``, nanoGPT's ``c_attn``) write ``softmax(q @ k^T * c + mask) @ v``
themselves, or call ``torch.nn.functional.scaled_dot_product_attention`` directly. While such a module runs,
an :class:`Interceptor` (a ``TorchFunctionMode``) follows that math symbolically:

=================================  =================================================================================
op in the module's forward          what the interceptor keeps
=================================  =================================================================================
``q @ k^T`` (4-D ``matmul``)        the raw scores ``R``, with ``q (B, H, Lq, d)`` and ``k (B, H, Lk, d)``
``* c``, ``/ c`` (a number)         the scale ``c`` (the scores are ``c * R + bias``, ``-inf`` where blocked)
``+ t``                             ``t``'s entries at or below half the dtype's minimum are *blocked*, the rest an
                                    additive bias (a mask built by the model, ALiBi, a relative-position term)
``masked_fill``, ``where``          a fill at or below half the dtype's minimum blocks those positions
casts, ``contiguous``, dropout      the dtype; dropout's probability when the module is training
``softmax(dim=-1)``                 the weights ``P``
``P @ v``                           **the attention call**: ``fn(module, q, k, v, mask, scaling=c, ...)``
``scaled_dot_product_attention``    the attention call, with the arguments the module gave
=================================  =================================================================================

With ``defer`` (the model runs on a headlab implementation), ``R``, the scores and ``P`` are never computed:
each is a zero-strided placeholder of the right shape, and the call's output replaces ``P @ v``; so the module
runs on headlab's backends, captures and gates as a module that calls the interface does. Any other op that
reads a placeholder (``tanh`` soft-capping, a clamp, a second use of ``R``) makes the chain real by replaying
the module's own ops on ``q @ k^T``, and the layer is *unserved*: :attr:`Interceptor.unserved` names the op
(the load-time discovery refuses such a module naming it; at run time it is an error, never a silent miss).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from headlab.models.hf.own_ops import (
    ADD,
    CAST,
    DIV,
    FILL,
    FLOOR,
    INPLACE,
    MATMUL,
    META,
    MUL,
    PROPS,
    SDPA,
    SHAPE_ONLY,
    SOFTMAX,
    VIEW,
    Attend,
    Chain,
    canon,
    is_causal,
    last_axis,
    low,
    placeholder,
    plus,
    replay,
    scalar,
    shape_arg,
)


class Interceptor(TorchFunctionMode):
    """Follows one module's attention math (see the module docstring).

    Args:
        attend: called at each attention (``P @ v`` or ``scaled_dot_product_attention``) as
            ``attend(q, k, v, mask, scaling=, dropout=, is_causal=)``, returning ``(out (B, H, Lq, dv), weights
            or None)``; None: the module's own math runs (discovery: only :attr:`events` are kept).
        defer: placeholders instead of the scores (only with ``attend``).
    """

    def __init__(
        self,
        attend: Attend | None = None,
        *,
        defer: bool = False,
        training: bool = False,
        here: Callable[[], Any] | None = None,
        heads: int | None = None,
    ):
        super().__init__()
        self.heads = heads  # heads of a module that folds them into the batch (its (B * H, L, d) math)
        self.attend = attend
        self.defer = defer and attend is not None
        self.training = training
        self.here = here  # discovery: the module running now (events and breaks name it)
        self.chains: dict[int, tuple[torch.Tensor, Chain]] = {}
        self.events: list[dict] = []  # one per attention found: shapes and whether it was served
        self.breaks: list[tuple[Any, str]] = []  # (module, op) where an op headlab cannot express read the chain
        self.unserved: str | None = None  # the op that broke the chain, if any
        self.dropped: str | None = None  # the last op that took a product off the chain before any softmax
        self.need = False  # the caller asked for the attention weights (output_attentions)

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def chain(self, t: Any) -> Chain | None:
        if not isinstance(t, torch.Tensor):
            return None
        hit = self.chains.get(id(t))
        return hit[1] if hit is not None and hit[0] is t else None

    def _keep(self, t: torch.Tensor, c: Chain) -> torch.Tensor:
        self.chains[id(t)] = (t, c)
        return t

    def real(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with its values: a placeholder made real by replaying the module's own ops."""
        c = self.chain(t)
        if c is None or not self.defer:
            return t
        return replay(c.ops, self.real)

    def _out(self, func, args, kwargs, pos: int, c: Chain, shape=None, dtype=None) -> torch.Tensor:
        """The result of a followed op: a placeholder (deferred) or the real result, carrying chain ``c``."""
        x = args[pos]
        c = replace(c, ops=(*c.ops, (func, tuple(args), dict(kwargs), pos)))
        if func in INPLACE:
            return self._keep(x if self.defer else func(*args, **kwargs), c)
        if self.defer:
            out = placeholder(shape if shape is not None else x.shape, dtype or x.dtype, x.device)
        else:
            out = func(*args, **kwargs)
        return self._keep(out, c)

    def _break(self, why: str, func, args, kwargs):
        """An op headlab cannot express reads the chain: make it real and run the op as the module wrote it. Past
        the softmax the layer's attention is unserved; before it, the product may not have been attention scores
        at all (DeBERTa's ``q @ pos_k^T``, gathered into a bias): the chain is dropped, and a softmax over a real
        tensor later (:meth:`_softmax_seen`) is what makes the layer unserved."""
        chains = [c for c in (self.chain(a) for a in (*args, *kwargs.values())) if c is not None]
        if any(c.weights or c.stage for c in chains):
            self._unserved(why)
        else:
            self.dropped = why
        flat = [self.real(a) if self.chain(a) is not None else a for a in args]
        kw = {k: (self.real(v) if self.chain(v) is not None else v) for k, v in kwargs.items()}
        return func(*flat, **kw)

    def _unserved(self, why: str) -> None:
        self.unserved = self.unserved or why
        self.breaks.append((self.here() if self.here is not None else None, why))

    def _softmax_seen(self, x: torch.Tensor) -> None:
        """A softmax over a real tensor: attention scores headlab did not follow (4-D, or after a dropped chain)."""
        if x.dim() >= 4 or (x.dim() == 3 and self.dropped is not None):
            self._unserved(
                self.dropped or "a softmax over scores headlab did not follow (einsum, or a product it did not see)"
            )

    # -- the mode ------------------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on = [i for i, a in enumerate(args) if self.chain(a) is not None]
        on_kw = [k for k, v in kwargs.items() if self.chain(v) is not None]
        if not on and not on_kw:
            if func in SOFTMAX and args and isinstance(args[0], torch.Tensor):
                self._softmax_seen(args[0])
            if func in SDPA:
                return self._sdpa(func, args, kwargs)
            if func in MATMUL and len(args) == 2 and self._is_scores(*args):
                q, kt = args
                k = kt.transpose(-1, -2)
                fold = q.dim() == 3
                if fold:  # (B * H, L, d): the heads the module has (found at discovery), else a batch of one
                    H = self.heads if self.heads and q.shape[0] % self.heads == 0 else q.shape[0]
                    q, k = q.reshape(-1, H, *q.shape[1:]), k.reshape(-1, H, *k.shape[1:])
                c = Chain(q=q, k=k, fold=fold, ops=((func, tuple(args), {}, None),))
                shape = (*torch.broadcast_shapes(args[0].shape[:-2], kt.shape[:-2]), args[0].shape[-2], kt.shape[-1])
                if self.defer:
                    return self._keep(placeholder(shape, torch.promote_types(q.dtype, kt.dtype), q.device), c)
                return self._keep(func(*args, **kwargs), c)
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in META or (name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") in PROPS):
            return func(*args, **kwargs)
        if name in SHAPE_ONLY and (name.endswith("_like") or name.startswith("new_") or 0 not in on) and not on_kw:
            return func(*args, **kwargs)  # the placeholder's shape, dtype and device are the real tensor's
        if name == "type_as" and on == [1] and not on_kw:
            return func(*args, **kwargs)
        if len(on) == 2 and not on_kw and len(args) == 2:
            done = self._by_hand(func, name, args, kwargs)
            if done is not None:
                return done
        if on_kw or len(on) != 1:
            return self._break(f"{name} of two tensors of the attention scores", func, args, kwargs)
        pos = on[0]
        x = args[pos]
        c = self.chain(x)
        assert c is not None
        other = args[1 - pos] if len(args) == 2 else None
        if c.weights:
            return self._on_weights(func, name, args, kwargs, pos, c)
        if c.stage:
            return self._staged(func, name, args, kwargs, pos, c)
        if name in ("amax", "max") and pos == 0 and last_axis(args[1:], kwargs, x) and kwargs.get("keepdim", True):
            shape = (*x.shape[:-1], 1)
            vals = self._out(func, args, kwargs, pos, replace(c, stage="rowmax"), shape=shape)
            if name == "amax":
                return vals
            return torch.return_types.max((vals, torch.zeros(shape, dtype=torch.long, device=x.device)))
        if name == "exp":
            return self._out(func, args, kwargs, pos, replace(c, stage="exp"))
        if func in SOFTMAX:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dim in (-1, x.dim() - 1):
                dtype = kwargs.get("dtype") or (args[2] if len(args) > 2 and isinstance(args[2], torch.dtype) else None)
                return self._out(func, args, kwargs, pos, replace(c, weights=True), dtype=dtype)
            return self._break(f"a softmax over axis {dim} of the scores", func, args, kwargs)
        if name in CAST and not any(isinstance(a, torch.device) for a in args[1:]):
            dtype = next((a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.dtype)), None)
            if name == "type_as" and isinstance(other, torch.Tensor):
                dtype = other.dtype
            dtype = dtype or {
                "float": torch.float32,
                "half": torch.float16,
                "bfloat16": torch.bfloat16,
                "double": torch.float64,
            }.get(name)
            return self._out(func, args, kwargs, pos, replace(c, detached=c.detached or name == "detach"), dtype=dtype)
        if name in VIEW and pos == 0:
            return self._view(func, name, args, kwargs, c)
        if func in FLOOR and len(args) == 2 and pos == 0 and low(other, x.dtype):
            return self._out(func, args, kwargs, pos, c)  # a floor at the dtype's minimum: blocked stays blocked
        if (func in MUL or (func in DIV and pos == 0)) and scalar(other) is not None and len(args) == 2:
            s = scalar(other)
            assert s is not None
            if s <= 0:
                return self._break(f"a scale of {s} on the scores", func, args, kwargs)
            s = s if func in MUL else 1.0 / s
            bias = None if c.bias is None else c.bias * s
            return self._out(func, args, kwargs, pos, replace(c, scale=c.scale * s, bias=bias))
        if func in ADD and len(args) == 2 and "alpha" not in kwargs:
            if scalar(other) is not None:
                return self._out(func, args, kwargs, pos, replace(c, bias=plus(c.bias, torch.tensor(scalar(other)))))
            if isinstance(other, torch.Tensor) and other.is_floating_point():
                shape = torch.broadcast_shapes(x.shape, other.shape)
                other = canon(other, c)
                under = other.detach() <= torch.finfo(other.dtype).min / 2
                fin = other.masked_fill(under, 0.0)
                blocked = under if c.blocked is None else (c.blocked | under)
                nb = plus(c.bias, fin) if bool(fin.detach().ne(0).any()) else c.bias
                return self._out(func, args, kwargs, pos, replace(c, bias=nb, blocked=blocked), shape=shape)
        if func in FILL and pos == 0 and len(args) >= 3 and low(args[2], x.dtype):
            m = canon(args[1], c)
            return self._out(func, args, kwargs, pos, replace(c, blocked=m if c.blocked is None else c.blocked | m))
        if func is torch.where and len(args) == 3 and pos in (1, 2):
            fill = args[3 - pos]
            if low(fill, x.dtype):
                cond = canon(args[0], c)
                keep = ~cond if pos == 1 else cond
                shape = torch.broadcast_shapes(args[0].shape, x.shape)
                return self._out(
                    func,
                    args,
                    kwargs,
                    pos,
                    replace(c, blocked=keep if c.blocked is None else c.blocked | keep),
                    shape=shape,
                )
        return self._break(f"{name} on the attention scores", func, args, kwargs)

    def _view(self, func, name, args, kwargs, c: Chain):
        """A view between the folded ``(B * H, Lq, Lk)`` and the ``(B, H, Lq, Lk)`` layouts (or onto itself)."""
        x = args[0]
        shape = shape_arg(args[1:], kwargs)
        B, H, Lq, Lk = x.shape[0] // c.q.shape[1] if c.fold else x.shape[0], c.q.shape[1], x.shape[-2], x.shape[-1]
        if shape is not None and shape[-2:] == (Lq, Lk):
            if len(shape) == 4 and shape[1] == H and c.fold:
                return self._out(func, args, kwargs, 0, replace(c, fold=False), shape=(B, H, Lq, Lk))
            if len(shape) == 3 and not c.fold and shape[0] in (B * H, -1):
                return self._out(func, args, kwargs, 0, replace(c, fold=True), shape=(B * H, Lq, Lk))
            if len(shape) == x.dim() and shape[0] in (x.shape[0], -1):
                return self._out(func, args, kwargs, 0, c, shape=tuple(x.shape))
        return self._break(
            f"a {name} of the attention {'weights' if c.weights else 'scores'} to {shape}", func, args, kwargs
        )

    def _staged(self, func, name, args, kwargs, pos, c: Chain):
        """Ops on the pieces of a softmax written by hand (the row maxima, ``exp`` and its row sums)."""
        x = args[pos]
        if c.stage == "rowmax" and (name in ("detach", "__getitem__") or name in CAST):
            return self._out(func, args, kwargs, pos, c)
        if c.stage == "exp" and name == "sum" and last_axis(args[1:], kwargs, x) and kwargs.get("keepdim", False):
            return self._out(func, args, kwargs, pos, replace(c, stage="sum"), shape=(*x.shape[:-1], 1))
        if c.stage in ("exp", "sum") and name in CAST:
            return self._out(func, args, kwargs, pos, c)
        return self._break(f"{name} on a softmax written by hand ({c.stage})", func, args, kwargs)

    def _by_hand(self, func, name, args, kwargs):
        """``scores - rowmax`` (a softmax is shift-invariant) and ``exp / sum`` (the weights)."""
        a, b = (self.chain(t) for t in args)
        assert a is not None and b is not None
        if name == "type_as":  # weights.type_as(scores): a cast
            return self._out(func, args, kwargs, 0, a, dtype=args[1].dtype)
        if a.q is not b.q:
            return None
        if name in ("sub", "__sub__") and not a.stage and not a.weights and b.stage == "rowmax":
            return self._out(func, args, kwargs, 0, a)
        if func in DIV and a.stage == "exp" and b.stage == "sum":
            return self._out(func, args, kwargs, 0, replace(a, stage="", weights=True))
        return None

    def _on_weights(self, func, name, args, kwargs, pos, c: Chain):
        if name in VIEW and pos == 0:
            return self._view(func, name, args, kwargs, c)
        if name in CAST and not any(isinstance(a, torch.device) for a in args[1:]):
            dtype = next((a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.dtype)), None)
            if name == "type_as" and isinstance(args[1 - pos], torch.Tensor):
                dtype = args[1 - pos].dtype
            return self._out(func, args, kwargs, pos, replace(c, detached=c.detached or name == "detach"), dtype=dtype)
        if func in FILL and pos == 0 and len(args) >= 3 and scalar(args[2]) == 0.0 and c.blocked is not None:
            m = canon(args[1], c)  # zeroing weights already zero (blocked keys; a fully masked row: headlab's zeros)
            if not bool((m & ~c.blocked).any()):
                return self._out(func, args, kwargs, pos, c)
        if func is F.dropout or name == "dropout":
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            dp = float(p) if training else 0.0
            return self._out(func, args, kwargs, pos, replace(c, dropout=dp))
        if func in MATMUL and pos == 0 and len(args) == 2 and isinstance(args[1], torch.Tensor):
            return self._attention(func, args, c)
        return self._break(f"{name} on the attention weights", func, args, kwargs)

    def _event(self, kind: str, q, k, v, *, causal: bool, bias: bool) -> dict:
        e = {
            "kind": kind,
            "q": tuple(q.shape),
            "k": tuple(k.shape),
            "v": tuple(v.shape),
            "causal": causal,
            "bias": bias,
            "module": self.here() if self.here is not None else None,
        }
        if self.attend is None:  # discovery keeps the tensors (grouped heads repeated by the module are found so)
            e["tensors"] = (k.detach(), v.detach())
        self.events.append(e)
        return e

    @staticmethod
    def _is_scores(a: Any, b: Any) -> bool:
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dim() == b.dim()
            and a.dim() in (3, 4)
            and a.is_floating_point()
            and b.is_floating_point()
            and a.shape[-1] == b.shape[-2]
        )

    # -- the attention call ------------------------------------------------------------------------------------------
    def _attention(self, func, args, c: Chain) -> torch.Tensor:
        v = args[1]
        q, k = c.q, c.k
        if c.fold:
            if v.dim() != 3 or v.shape[0] != q.shape[0] * q.shape[1]:
                return self._break(f"an attention over a value of shape {tuple(v.shape)}", func, args, {})
            v = v.reshape(q.shape[0], q.shape[1], *v.shape[1:])
        mask = c.additive()
        causal = False
        Lq, Lk = q.shape[2], k.shape[2]
        if c.bias is None and c.blocked is not None and Lq == Lk > 1:
            tri = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril()
            b = c.blocked
            if b.dim() >= 2 and tuple(b.shape[-2:]) == (Lq, Lk) and bool((b == ~tri).all()):
                mask, causal = None, True
        event = self._event("math", q, k, v, causal=causal or is_causal(c.blocked, Lq, Lk), bias=c.bias is not None)
        if self.attend is None or v.dim() != 4 or q.shape[1] != k.shape[1] or k.shape[1] != v.shape[1]:
            if self.attend is not None:
                self.unserved = self.unserved or f"an attention over a value of shape {tuple(v.shape)}"
            return func(self.real(args[0]), args[1])
        dtype = torch.promote_types(args[0].dtype, v.dtype)
        if c.detached:
            q, k = q.detach(), k.detach()
        out, weights = self.attend(
            q.to(v.dtype),
            k.to(v.dtype),
            v,
            mask,
            scaling=c.scale,
            dropout=c.dropout if self.training else 0.0,
            is_causal=causal,
        )
        c.result = weights
        event["served"] = True
        out = out.to(dtype)
        return out.reshape(-1, *out.shape[2:]) if c.fold else out

    def _sdpa(self, func, args, kwargs) -> torch.Tensor:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        a = dict(zip(names, args))
        a.update(kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        mask = a.get("attn_mask")
        causal = bool(a.get("is_causal", False))
        self._event("sdpa", q, k, v, causal=causal and mask is None, bias=False)
        if self.attend is None or q.dim() != 4:
            return func(*args, **kwargs)
        if mask is not None and causal:
            Lq, Lk = q.shape[2], k.shape[2]
            tri = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(Lk - Lq)
            mask = (mask & tri) if mask.dtype == torch.bool else mask.masked_fill(~tri, float("-inf"))
            causal = False
        if causal and q.shape[2] != k.shape[2]:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
            mask, causal = mask[None, None], False
        if mask is not None and mask.dim() < 4:
            mask = mask.reshape(*([1] * (4 - mask.dim())), *mask.shape)
        scale = a.get("scale")
        out, _ = self.attend(
            q,
            k,
            v,
            mask,
            scaling=scale if scale is not None else q.shape[-1] ** -0.5,
            dropout=float(a.get("dropout_p", 0.0)) if self.training else 0.0,
            is_causal=causal,
        )
        self.events[-1]["served"] = True
        return out


__all__ = ["Chain", "Interceptor"]
