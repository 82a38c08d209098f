"""OPT: a pre-LN decoder (``do_layer_norm_before``; OPT-350m's post-LN layout too) with learned positions."""

from __future__ import annotations

from headlab.models.hf.family import HFAdapter, Norms, Out
from headlab.models.hf.registry import register


@register
class OPTAdapter(HFAdapter):
    family = "opt"
    model_types = ("opt",)
    description = "OPT"
    is_decoder = True
    layers = "decoder.layers"
    out = Out("self_attn.out_proj")
    head_attrs = {"num_heads": "H"}
    positions = "absolute"

    @property
    def norms(self) -> Norms:  # type: ignore[override]  # read from the config: a property where other families declare a ClassVar
        if getattr(self.model.config, "do_layer_norm_before", True):
            return Norms(pre="self_attn_layer_norm", kind="layernorm")
        return Norms(post="self_attn_layer_norm", kind="layernorm")

    @classmethod
    def max_positions(cls, config) -> int:
        return int(config.max_position_embeddings)
