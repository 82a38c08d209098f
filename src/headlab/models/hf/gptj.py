"""GPT-J: separate projections without biases, partial rotary, attention and MLP in parallel on ``ln_1``."""

from __future__ import annotations

from headlab.models.hf.family import HFAdapter, Norms, Out, Separate
from headlab.models.hf.registry import register


@register
class GPTJAdapter(HFAdapter):
    family = "gptj"
    model_types = ("gptj",)
    description = "GPT-J"
    is_decoder = True
    layers = "h"
    attention = "attn"
    projections = Separate()
    out = Out("attn.out_proj")
    norms = Norms(pre="ln_1", kind="layernorm", parallel="mlp")
    head_attrs = {"num_attention_heads": "H"}
