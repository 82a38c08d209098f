"""ALBERT: one block's weights shared by every layer (``num_hidden_groups`` groups of ``inner_group_num``
layers), BERT's attention inside ``AlbertAttention`` with its post-LN.

Each layer the model computes is a layer here (``n_layers = num_hidden_layers * inner_group_num``) with its
own gates, sites and statistics; the shared module takes the state of the layer it is computing
(:attr:`~headlab.models.base.ModelAdapter.shared_layers`). Pruning removes a head from the shared weights,
so it must remove the same heads in every layer that shares them (else a typed refusal).
"""

from __future__ import annotations

from headlab.models.hf.family import HFAdapter, Norms, Out, Separate
from headlab.models.hf.registry import register


@register
class AlbertAdapter(HFAdapter):
    family = "albert"
    model_types = ("albert",)
    description = "ALBERT (layers share weights)"
    attention = "attention"
    projections = Separate("query", "key", "value")
    out = Out("attention.dense")
    norms = Norms(post="attention.LayerNorm", kind="layernorm")
    head_attrs = {"num_attention_heads": "H", "all_head_size": "H*d"}
    positions = "absolute"
    limits = {"pruning": "the same heads in every layer sharing a block", "gates": "per layer, on shared weights"}

    def _blocks(self, model):
        cfg, enc = model.config, model.base_model.encoder
        per_group = cfg.num_hidden_layers // cfg.num_hidden_groups
        return [
            layer
            for i in range(cfg.num_hidden_layers)
            for layer in enc.albert_layer_groups[i // per_group].albert_layers
        ]
