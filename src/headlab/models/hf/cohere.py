"""Cohere (Command R): Llama's projections in a parallel block, ``x + Attn(LN(x)) + MLP(LN(x))``."""

from __future__ import annotations

from headlab.models.hf.family import HFAdapter, Norms
from headlab.models.hf.registry import register


@register
class CohereAdapter(HFAdapter):
    family = "cohere"
    model_types = ("cohere",)
    description = "Cohere (Command R)"
    is_decoder = True
    norms = Norms(pre="input_layernorm", kind="layernorm", parallel="mlp")
    head_attrs = {"num_key_value_groups": "G"}
