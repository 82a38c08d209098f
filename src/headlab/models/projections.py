"""Where a family keeps W_Q, W_K, W_V and W^O, and how heads are read from them and cut out of them.

A layout is declared once per family (:class:`~headlab.models.hf.family.HFAdapter`; headlab's own
Transformer uses ``Separate`` and ``Out`` too); the adapter's per-head views, physical pruning and the
model's head counts all follow from it.

============================  ====================================================  ===========================
layout                        rows of the projection's output                        families
============================  ====================================================  ===========================
``Separate(q, k, v)``         three modules, ``heads * d`` rows each                 BERT, Llama, OPT, GPT-J, ...
``Fused(name)``               ``[Q (H*d) | K (Hkv*d) | V (Hkv*d)]``                  Phi-3, ModernBERT, GPT-2
``Fused(name, "per_head")``   ``(H, 3, d)``: q, k, v of head 0, then of head 1, ...  GPT-NeoX, BLOOM
``Fused(name, "grouped")``    ``(Hkv, G + 2, d)``: G queries, then k, v, per group   Falcon (new architecture)
============================  ====================================================  ===========================

``conv1d=True`` says the module is GPT-2's ``Conv1D`` (``weight (in, out)``, ``x @ weight``) rather than
``nn.Linear`` (``weight (out, in)``, ``x @ weight.T``). Views are views where the layout allows it
(every layout but ``grouped`` for W_Q): editing them edits the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def get_module(module: Any, path: str) -> Any:
    """The submodule at a dotted path (digits index a ModuleList)."""
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def feature_rows(heads, d: int, offset: int = 0) -> list[int]:
    return [offset + h * d + i for h in heads for i in range(d)]


def keep_features(module: Any, idx: list[int], *, conv1d: bool, side: str) -> None:
    """Keep output features (``side="out"``) or input features (``"in"``) ``idx`` of a Linear/Conv1D, in place."""
    w = module.weight.data
    t = torch.tensor(idx, dtype=torch.long, device=w.device)
    out_axis = 1 if conv1d else 0
    axis = out_axis if side == "out" else 1 - out_axis
    module.weight = nn.Parameter(w.index_select(axis, t).clone(), requires_grad=module.weight.requires_grad)
    if side == "out" and getattr(module, "bias", None) is not None:
        module.bias = nn.Parameter(module.bias.data[t].clone(), requires_grad=module.bias.requires_grad)
    if conv1d:
        if side == "out":
            module.nf = len(idx)
        else:
            module.nx = len(idx)
    elif side == "out":
        module.out_features = len(idx)
    else:
        module.in_features = len(idx)


def _in_view(weight: torch.Tensor, rows: slice | None, heads: int, d: int, conv1d: bool) -> torch.Tensor:
    """``(heads, E, d)`` from the output rows ``rows`` of a projection (a view)."""
    if conv1d:
        w = weight if rows is None else weight[:, rows]  # (E, heads*d)
        return w.view(w.shape[0], heads, d).transpose(0, 1)
    w = weight if rows is None else weight[rows]  # (heads*d, E)
    return w.view(heads, d, w.shape[1]).transpose(1, 2)


@dataclass(frozen=True)
class Separate:
    """Three projection modules (paths relative to the attention module)."""

    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    conv1d: bool = False

    def module(self, attn: nn.Module, which: str) -> nn.Module:
        return get_module(attn, getattr(self, which))

    def weight(self, attn, which, H, Hkv, d):
        heads = H if which == "q" else Hkv
        return _in_view(self.module(attn, which).weight, None, heads, d, self.conv1d)

    def bias(self, attn, which, H, Hkv, d):
        b = getattr(self.module(attn, which), "bias", None)
        return None if b is None else b.view(H if which == "q" else Hkv, d)

    def cut(self, attn, q_heads, kv_heads, H, Hkv, d) -> None:
        for which, heads in (("q", q_heads), ("k", kv_heads), ("v", kv_heads)):
            keep_features(self.module(attn, which), feature_rows(heads, d), conv1d=self.conv1d, side="out")


@dataclass(frozen=True)
class Fused:
    """One projection computing q, k and v (path relative to the attention module); ``order`` as in the
    module docstring: ``"blocks"``, ``"per_head"`` or ``"grouped"``."""

    name: str
    order: str = "blocks"
    conv1d: bool = False

    def module(self, attn: nn.Module, which: str | None = None) -> nn.Module:
        return get_module(attn, self.name)

    def _rows(self, which: str, heads, H: int, Hkv: int, d: int) -> list[int]:
        """Output features of ``heads`` (query heads for q, kv heads for k and v) in the fused axis."""
        i = "qkv".index(which)
        if self.order == "blocks":
            return feature_rows(heads, d, (0, H * d, (H + Hkv) * d)[i])
        if self.order == "per_head":
            return [h * 3 * d + i * d + j for h in heads for j in range(d)]
        G = H // Hkv
        if which == "q":
            return [(h // G) * (G + 2) * d + (h % G) * d + j for h in heads for j in range(d)]
        return [g * (G + 2) * d + (G + i - 1) * d + j for g in heads for j in range(d)]

    def weight(self, attn, which, H, Hkv, d):
        w = self.module(attn).weight
        heads = H if which == "q" else Hkv
        i = "qkv".index(which)
        if self.order == "blocks":
            start = (0, H * d, (H + Hkv) * d)[i]
            return _in_view(w, slice(start, start + heads * d), heads, d, self.conv1d)
        if not self.conv1d:  # per head: a view; grouped: a copy
            return self._by_view(w, which, H, Hkv, d).transpose(1, 2)  # (heads, E, d)
        rows = torch.tensor(self._rows(which, range(heads), H, Hkv, d), device=w.device)
        return _in_view(w.index_select(1 if self.conv1d else 0, rows), None, heads, d, self.conv1d)  # a copy

    def bias(self, attn, which, H, Hkv, d):
        b = getattr(self.module(attn), "bias", None)
        if b is None:
            return None
        if self.order != "blocks":
            return self._by_view(b, which, H, Hkv, d)
        heads = H if which == "q" else Hkv
        return b[self._rows(which, range(heads), H, Hkv, d)].view(heads, d)

    def _by_view(self, t, which: str, H: int, Hkv: int, d: int) -> torch.Tensor:
        """``(heads, d, ...)``: the q, k or v rows of a per-head or grouped fused weight or bias, by reshaping alone
        (no index list, which a weight sharded by tensor parallelism, a DTensor, would not take)."""
        i, rest = "qkv".index(which), t.shape[1:]
        if self.order == "per_head":
            return t.view(H, 3, d, *rest)[:, i]
        G = H // Hkv
        g = t.view(Hkv, G + 2, d, *rest)
        return g[:, :G].reshape(H, d, *rest) if which == "q" else g[:, G + i - 1]

    def cut(self, attn, q_heads, kv_heads, H, Hkv, d) -> None:
        if self.order == "blocks":
            idx = [
                *self._rows("q", q_heads, H, Hkv, d),
                *self._rows("k", kv_heads, H, Hkv, d),
                *self._rows("v", kv_heads, H, Hkv, d),
            ]
        elif self.order == "per_head":  # no grouped-query attention in this layout: q_heads == kv_heads
            idx = [h * 3 * d + j for h in q_heads for j in range(3 * d)]
        else:  # grouped: every kept group, its kept query heads, then its k and v
            G = H // Hkv
            idx = []
            for g in kv_heads:
                idx += self._rows("q", [h for h in q_heads if h // G == g], H, Hkv, d)
                idx += self._rows("k", [g], H, Hkv, d) + self._rows("v", [g], H, Hkv, d)
        keep_features(self.module(attn), idx, conv1d=self.conv1d, side="out")


@dataclass(frozen=True)
class Out:
    """W^O: ``nn.Linear(H*d -> E)`` (or ``Conv1D`` with ``conv1d=True``); path relative to the block."""

    path: str
    conv1d: bool = False

    def weight(self, op: Any, H: int, d: int) -> torch.Tensor:  # op: a Linear or transformers' Conv1D
        """``(H, d, E)``, a view."""
        w = op.weight
        if self.conv1d:
            return w.view(H, d, w.shape[1])
        return w.t().view(H, d, w.shape[0])

    def cut(self, op: nn.Module, q_heads, d: int) -> None:
        keep_features(op, feature_rows(q_heads, d), conv1d=self.conv1d, side="in")

    def zero(self, op: Any, local_heads, d: int) -> None:
        """Set W^O's block of ``local_heads`` (indices in the layer as it is now) to zero."""
        if not local_heads:
            return
        idx = torch.tensor(feature_rows(local_heads, d), device=op.weight.device)
        with torch.no_grad():
            if self.conv1d:
                op.weight[idx] = 0.0
            else:
                op.weight[:, idx] = 0.0


__all__ = ["Fused", "Out", "Separate", "feature_rows", "get_module", "keep_features"]
