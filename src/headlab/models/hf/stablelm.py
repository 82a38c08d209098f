"""StableLM: Llama's layout with LayerNorm, partial rotary and optional per-head q/k LayerNorms."""

from __future__ import annotations

from torch import nn

from headlab.models.hf.family import HFAdapter, Norms
from headlab.models.hf.registry import register


@register
class StableLmAdapter(HFAdapter):
    family = "stablelm"
    model_types = ("stablelm",)
    description = "StableLM"
    is_decoder = True
    norms = Norms(pre="input_layernorm", kind="layernorm")
    head_attrs = {"num_heads": "H", "num_key_value_heads": "Hkv", "num_key_value_groups": "G"}
    stock_config = False

    def cut_heads(self, attn, out, q_heads, kv_heads, H, Hkv):
        super().cut_heads(attn, out, q_heads, kv_heads, H, Hkv)
        if getattr(attn, "qk_layernorm", False):  # one LayerNorm per head: keep the kept heads' ones
            attn.q_layernorm.norms = nn.ModuleList([attn.q_layernorm.norms[h] for h in q_heads])
            attn.k_layernorm.norms = nn.ModuleList([attn.k_layernorm.norms[h] for h in kv_heads])
