"""Phi-3: Llama's block with a fused ``qkv_proj`` = [Q | K | V] (grouped-query attention)."""

from __future__ import annotations

import copy

from headlab.models.hf.family import Fused, HFAdapter, Out
from headlab.models.hf.registry import register


@register
class Phi3Adapter(HFAdapter):
    family = "phi3"
    model_types = ("phi3",)
    description = "Phi-3"
    is_decoder = True
    projections = Fused("qkv_proj")
    out = Out("self_attn.o_proj")
    head_attrs = {"num_key_value_heads": "Hkv", "num_key_value_groups": "G"}
    stock_config = True
    score_mods = "sliding window (when configured)"

    def cut_heads(self, attn, out, q_heads, kv_heads, H, Hkv):
        super().cut_heads(attn, out, q_heads, kv_heads, H, Hkv)
        # Phi-3 splits its fused output at config.num_attention_heads * head_dim: give the layer its own count
        attn.config = copy.copy(attn.config)
        attn.config.num_attention_heads = len(q_heads)
