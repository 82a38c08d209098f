"""The ops the interceptor of :mod:`headlab.models.hf.own_math` recognises in a module's attention math, the
:class:`Chain` it keeps for a tensor on the attention chain, and the small readings of op arguments it needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
VIEW = {"view", "reshape"}
FLOOR = {torch.max, torch.maximum, torch.Tensor.max, torch.Tensor.maximum}
SOFTMAX = {
    torch.softmax,
    torch.Tensor.softmax,
    F.softmax,
    torch._C._nn.softmax if hasattr(torch._C._nn, "softmax") else torch.softmax,
}
SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
MUL = {
    torch.mul,
    torch.Tensor.mul,
    torch.Tensor.__mul__,
    torch.Tensor.__rmul__,
    torch.Tensor.mul_,
    torch.Tensor.__imul__,
}
DIV = {torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.div_, torch.Tensor.__itruediv__}
ADD = {
    torch.add,
    torch.Tensor.add,
    torch.Tensor.__add__,
    torch.Tensor.__radd__,
    torch.Tensor.add_,
    torch.Tensor.__iadd__,
}
FILL = {torch.Tensor.masked_fill, torch.Tensor.masked_fill_, torch.masked_fill}
CAST = {"to", "float", "half", "bfloat16", "double", "type_as", "contiguous", "clone", "type", "detach"}
META = {
    "size",
    "dim",
    "numel",
    "is_floating_point",
    "__len__",
    "stride",
    "is_contiguous",
    "element_size",
    "get_device",
    "ndimension",
    "nelement",
}
# ops that read only the shape, dtype or device of a chain tensor: run on its placeholder as they are
SHAPE_ONLY = {
    "expand_as",
    "view_as",
    "reshape_as",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty",
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_like",
}
PROPS = {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad", "is_leaf", "is_meta"}
INPLACE = {
    torch.Tensor.mul_,
    torch.Tensor.__imul__,
    torch.Tensor.div_,
    torch.Tensor.__itruediv__,
    torch.Tensor.add_,
    torch.Tensor.__iadd__,
    torch.Tensor.masked_fill_,
}


def low(x: Any, dtype: torch.dtype) -> bool:
    """Is every value of ``x`` (a number or tensor) at or below half of ``dtype``'s minimum (a blocked score)?"""
    lim = torch.finfo(dtype).min / 2 if dtype.is_floating_point else float("-inf")
    if isinstance(x, torch.Tensor):
        return bool((x.detach() <= lim).all()) if x.numel() else False
    return isinstance(x, int | float) and x <= lim


@dataclass
class Chain:
    """What a tensor on the attention chain is: ``c * (q @ k^T) + bias``, blocked where ``blocked`` is True,
    then (``weights``) its softmax. ``ops`` replays the module's own ops from ``q @ k^T`` (to make it real)."""

    q: torch.Tensor
    k: torch.Tensor
    scale: float = 1.0
    bias: torch.Tensor | None = None
    blocked: torch.Tensor | None = None
    weights: bool = False
    stage: str = ""  # a softmax written by hand: "rowmax" (the row maxima), "exp", "sum" (the row sums of exp)
    dropout: float = 0.0
    fold: bool = False  # the tensor is (B * H, Lq, Lk), heads folded into the batch (q, k, bias stay 4-D)
    detached: bool = False  # the module detached the scores or weights: no gradient reaches q and k through them
    ops: tuple = ()
    result: torch.Tensor | None = field(default=None, repr=False)  # the weights the attention call returned

    def additive(self) -> torch.Tensor | None:
        """The bias and the blocked positions as one float32 additive mask (``-inf`` = blocked), or None."""
        if self.bias is None and self.blocked is None:
            return None
        parts = [t for t in (self.bias, self.blocked) if t is not None]
        shape = torch.broadcast_shapes(*(t.shape for t in parts))
        m = torch.zeros(shape, dtype=torch.float32, device=self.q.device)
        if self.bias is not None:
            m = m + self.bias.float()
        if self.blocked is not None:
            m = m.masked_fill(self.blocked, float("-inf"))
        while m.dim() < 4:
            m = m.unsqueeze(0)
        return m


def replay(ops: tuple, real: Callable[[Any], Any]) -> torch.Tensor:
    """The module's own ops from ``q @ k^T`` on real tensors (``real`` resolves other placeholders an op reads)."""
    x = None
    for func, args, kwargs, pos in ops:
        a = [t if i == pos else real(t) for i, t in enumerate(args)]
        if pos is not None:
            a[pos] = x
        x = func(*a, **kwargs)
    assert isinstance(x, torch.Tensor)
    return x


def placeholder(shape, dtype, device) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=device).expand(*shape)


Attend = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def canon(t: torch.Tensor, c: Chain) -> torch.Tensor:
    """A mask or bias given for the chain's current layout as a 4-D ``(B|1, H|1, Lq|1, Lk)`` tensor."""
    if not c.fold or t.dim() > 3:
        return t
    t = t.reshape(*([1] * (3 - t.dim())), *t.shape)
    if t.shape[0] == 1:
        return t.unsqueeze(0)
    B, H = c.q.shape[0], c.q.shape[1]
    return t.reshape(B, H, *t.shape[1:])


def last_axis(args, kwargs, x: torch.Tensor) -> bool:
    """Is the reduction's ``dim`` the last axis?"""
    d = kwargs.get("dim", args[0] if args else None)
    d = d[0] if isinstance(d, tuple | list) and len(d) == 1 else d
    return isinstance(d, int) and d in (-1, x.dim() - 1)


def shape_arg(args, kwargs) -> tuple | None:
    a = kwargs.get("shape", kwargs.get("size", args[0] if len(args) == 1 else (args if args else None)))
    if isinstance(a, torch.Size | tuple | list) and all(isinstance(i, int) for i in a):
        return tuple(a)
    return None


def is_causal(blocked: torch.Tensor | None, Lq: int, Lk: int) -> bool:
    """Is ``blocked`` exactly the positions after each query (the causal pattern, keys aligned at the end)?"""
    if blocked is None or Lq < 2 or blocked.dim() < 2 or tuple(blocked.shape[-2:]) != (Lq, Lk):
        return False
    tri = torch.ones(Lq, Lk, dtype=torch.bool, device=blocked.device).tril(Lk - Lq)
    return bool((blocked == ~tri).all())


def scalar(x: Any) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int | float):
        return float(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and x.dim() == 0 and x.is_floating_point():
        return float(x)
    return None


def plus(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else a + b


__all__ = [
    "SHAPE_ONLY",
    "ADD",
    "Attend",
    "CAST",
    "Chain",
    "DIV",
    "FILL",
    "FLOOR",
    "INPLACE",
    "MATMUL",
    "META",
    "MUL",
    "PROPS",
    "SDPA",
    "SOFTMAX",
    "VIEW",
    "canon",
    "is_causal",
    "last_axis",
    "low",
    "placeholder",
    "plus",
    "replay",
    "scalar",
    "shape_arg",
]
