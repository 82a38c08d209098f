"""GPT-2: a fused ``c_attn`` Conv1D ``(E, 3E)`` = [W_Q | W_K | W_V] and ``c_proj`` (W^O, Conv1D); pre-LN."""

from __future__ import annotations

from headlab.models.hf.family import Fused, HFAdapter, Norms, Out
from headlab.models.hf.registry import register


@register
class GPT2Adapter(HFAdapter):
    family = "gpt2"
    model_types = ("gpt2",)
    description = "GPT-2"
    is_decoder = True
    layers = "h"
    attention = "attn"
    projections = Fused("c_attn", conv1d=True)
    out = Out("attn.c_proj", conv1d=True)
    norms = Norms(pre="ln_1", kind="layernorm")
    head_attrs = {"num_heads": "H", "split_size": "H*d"}
    positions = "absolute"
