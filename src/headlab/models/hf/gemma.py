"""Gemma 2 and Gemma 3: Llama's projections in a sandwich block, ``x + post(Attn(pre(x)))``, RMSNorms that
scale by ``1 + w``; Gemma 2 soft-caps its scores (``attn_logit_softcapping``), both alternate sliding-window
and global layers, Gemma 3 normalises q and k per head."""

from __future__ import annotations

from headlab.models.hf.family import HFAdapter, Norms
from headlab.models.hf.registry import register


@register
class GemmaAdapter(HFAdapter):
    family = "gemma"
    model_types = ("gemma2", "gemma3_text")
    description = "Gemma 2 and 3"
    is_decoder = True
    norms = Norms(
        pre="input_layernorm", post="post_attention_layernorm", post_reads="branch", kind="rmsnorm", offset=1.0
    )
    head_attrs = {"num_key_value_groups": "G"}
    stock_config = True
    score_mods = "soft-capping (Gemma 2), sliding window on alternate layers"
    limits = {"backends": "sdpa refused when soft-capping", "norms": "stream=False when soft-capping"}
