"""ViT: a pre-LN encoder over image patches (``pixel_values`` in, the [CLS] patch first)."""

from __future__ import annotations

from headlab.models.hf.family import HFAdapter, Norms, Out, Separate
from headlab.models.hf.registry import register


@register
class ViTAdapter(HFAdapter):
    family = "vit"
    model_types = ("vit",)
    description = "Vision Transformer (ViT)"
    attention = "attention"
    projections = Separate()
    out = Out("attention.o_proj")
    norms = Norms(pre="layernorm_before", kind="layernorm")
    head_attrs = {"num_attention_heads": "H"}
    positions = "absolute"

    @classmethod
    def max_positions(cls, config) -> int:  # the patches of one image and [CLS]
        return (config.image_size // config.patch_size) ** 2 + 1
