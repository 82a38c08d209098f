"""DistilBERT: BERT's layout under other names (``q_lin``, ``k_lin``, ``v_lin``, ``out_lin``), post-LN."""

from __future__ import annotations

from headlab.models.hf.family import HFAdapter, Norms, Out, Separate
from headlab.models.hf.registry import register


@register
class DistilBertAdapter(HFAdapter):
    family = "distilbert"
    model_types = ("distilbert",)
    description = "DistilBERT"
    layers = "transformer.layer"
    attention = "attention"
    projections = Separate("q_lin", "k_lin", "v_lin")
    out = Out("attention.out_lin")
    norms = Norms(post="sa_layer_norm", kind="layernorm")
    head_attrs = {"n_heads": "H"}
    positions = "absolute"
