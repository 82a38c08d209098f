"""Llama-style decoders: ``layers[l].self_attn`` with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, pre-norm.

Llama (SmolLM2 is one), Mistral, Mixtral, Qwen2, Qwen3 (per-head q/k RMSNorm), Gemma (RMSNorm ``1 + w``),
OLMo (parameter-free LayerNorm, optional q/k/v clipping), StarCoder2 (LayerNorm, biases). The q and k
sites hold queries and keys *after* the rotary embedding (and any per-head q/k norm), what the scores
see; ``x @ W_Q[h] + b_Q[h]`` equals the captured q only before them.
"""

from __future__ import annotations

from headlab.models.hf.family import HFAdapter
from headlab.models.hf.registry import register


@register
class LlamaAdapter(HFAdapter):
    family = "llama"
    model_types = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "olmo", "starcoder2")
    description = "Llama-style decoders with grouped-query attention"
    is_decoder = True
    head_attrs = {"num_key_value_groups": "G"}
    stock_config = True
    score_mods = "sliding window (Mistral, Qwen, StarCoder2, when configured)"
