"""ModernBERT: a pre-LN encoder with a fused ``Wqkv``, rotary positions and local (sliding-window) layers."""

from __future__ import annotations

from headlab.models.hf.family import Fused, HFAdapter, Norms, Out
from headlab.models.hf.registry import register


@register
class ModernBertAdapter(HFAdapter):
    family = "modernbert"
    model_types = ("modernbert",)
    description = "ModernBERT"
    attention = "attn"
    projections = Fused("Wqkv")
    out = Out("attn.Wo")
    norms = Norms(pre="attn_norm", kind="layernorm")  # layer 0's attn_norm is an Identity
    score_mods = "sliding window on local layers"
