"""OLMo 2: Llama's projections, RMSNorm on q and k across *all* heads, and the norm after the attention on its
branch only: ``x + post(Attn(x))`` (no norm before the attention).

Because q_norm and k_norm normalise every head's query (key) together, removing a head would change the
others' queries. Pruning therefore keeps ``q_proj`` and ``k_proj`` whole, normalises as the model does, and then
keeps the surviving heads' columns (:class:`KeepColumns`); ``v_proj``, ``o_proj`` and the attention itself
shrink. The result equals the gated model exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from headlab.models.hf.family import HFAdapter, Norms
from headlab.models.hf.registry import register
from headlab.models.projections import feature_rows, keep_features


class KeepColumns(nn.Module):
    """``norm(x)[..., idx]``: a norm across every head, then only the kept heads' features."""

    def __init__(self, norm: nn.Module, idx: list[int]) -> None:
        super().__init__()
        self.norm = norm
        self.register_buffer("idx", torch.tensor(idx, dtype=torch.long), persistent=False)

    def forward(self, x):
        return self.norm(x).index_select(-1, self.idx.to(x.device))


@register
class Olmo2Adapter(HFAdapter):
    family = "olmo2"
    model_types = ("olmo2",)
    description = "OLMo 2"
    is_decoder = True
    norms = Norms(post="post_attention_layernorm", post_reads="branch", kind="rmsnorm")
    head_attrs = {"num_key_value_groups": "G"}
    limits = {"pruning": "q_proj and k_proj stay whole (q/k norms span all heads)"}

    def cut_heads(self, attn, out, q_heads, kv_heads, H, Hkv):
        d = self.head_dim
        q_idx, kv_idx = feature_rows(q_heads, d), feature_rows(kv_heads, d)
        for name, idx in (("q_norm", q_idx), ("k_norm", kv_idx)):
            norm = getattr(attn, name)
            if isinstance(norm, KeepColumns):  # pruned before: compose the selections
                norm.idx = norm.idx[torch.tensor(idx)]
            else:
                setattr(attn, name, KeepColumns(norm, idx))
        keep_features(attn.v_proj, kv_idx, conv1d=False, side="out")
        self.out.cut(out, q_heads, d)
        attn.num_key_value_groups = len(q_heads) // len(kv_heads)

    def _weights(self, layer, which):
        sel = self._kept(layer, which)
        if sel is None:
            return super()._weights(layer, which)
        d = self.head_dim
        w = getattr(self.attn_modules[layer], f"{which}_proj").weight[sel]  # (n*d, E), a copy
        return w.view(-1, d, w.shape[1]).transpose(1, 2)

    def _bias(self, layer, which):
        sel = self._kept(layer, which)
        if sel is None:
            return super()._bias(layer, which)
        b = getattr(self.attn_modules[layer], f"{which}_proj").bias
        return None if b is None else b[sel].view(-1, self.head_dim)

    def _kept(self, layer, which):
        if which not in "qk":
            return None
        norm = getattr(self.attn_modules[layer], f"{which}_norm")
        return norm.idx if isinstance(norm, KeepColumns) else None
