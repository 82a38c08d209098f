"""Phi (1, 1.5, 2): separate projections, W^O is ``dense``, partial rotary, attention and MLP in parallel."""

from __future__ import annotations

from headlab.models.hf.family import HFAdapter, Norms, Out, Separate
from headlab.models.hf.registry import register


@register
class PhiAdapter(HFAdapter):
    family = "phi"
    model_types = ("phi",)
    description = "Phi (1, 1.5, 2)"
    is_decoder = True
    projections = Separate()
    out = Out("self_attn.dense")
    norms = Norms(pre="input_layernorm", kind="layernorm", parallel="mlp")
    head_attrs = {"num_key_value_groups": "G"}
