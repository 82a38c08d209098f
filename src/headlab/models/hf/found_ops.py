"""What an adapter class found by structure (:mod:`headlab.models.hf.structure`) does beyond its declaration:
physical head removal checked against the norms inside its attention, and residual-mode norms refused with the
reason structure gave when it identified no layout."""

from __future__ import annotations

import torch

from headlab.errors import UnsupportedArchitectureError
from headlab.models.hf.family import HFAdapter
from headlab.models.hf.trace import is_norm


def cut_found(self, attn, out, q_heads, kv_heads, H, Hkv):
    """Physical head removal for a layout found by structure: the family's projections and W^O are cut as a
    declared family's are. A norm inside the attention that spans every head's features together (OLMoE's
    q_norm) would renormalise the kept heads differently: refused, with the reason. A layer whose scores get
    a per-head bias the model computes for all its original heads (a relative position bias) keeps the bias
    rows of its kept heads, which headlab's attention function selects, so the pruned model runs on headlab's
    attention implementation."""
    from headlab.errors import PruneError

    d = self.head_dim
    for n, m in attn.named_modules():
        w = getattr(m, "weight", None)
        if (
            is_norm(m)
            and isinstance(w, torch.Tensor)
            and w.dim() == 1
            and w.numel() in (H * d, Hkv * d)
            and w.numel() != d
        ):
            raise PruneError(
                f"the {self.family!r} attention normalises all heads' features together ({n}: "
                f"{w.numel()} features), so removing a head would change the others; gate heads "
                "instead (adapter.gates), or declare the layout in a family class as OLMo 2's does"
            )
    HFAdapter.cut_heads(self, attn, out, q_heads, kv_heads, H, Hkv)
    if "mask_bias" not in self.found.kwargs and "position_bias" not in self.found.kwargs:
        return
    before = getattr(attn, "_headlab_bias_heads", list(range(H)))
    attn._headlab_bias_heads = [before[h] for h in q_heads]
    cfg = getattr(attn, "config", None)  # the pruned copy's config (as T5's family does)
    if cfg is not None:
        cfg._attn_implementation = "headlab"


def no_norms(why: str):
    def attention_norm(self, layer: int):
        raise UnsupportedArchitectureError(
            f"residual-mode norms are not available for {self.family!r}: {why}; use mode='attention'"
        )

    return attention_norm


__all__ = ["cut_found", "no_norms"]
