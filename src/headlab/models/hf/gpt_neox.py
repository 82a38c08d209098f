"""GPT-NeoX (Pythia): a fused ``query_key_value`` laid out per head ``(H, 3, d)``, partial rotary, parallel
attention and MLP (``use_parallel_residual``, the default)."""

from __future__ import annotations

from headlab.models.hf.family import Fused, HFAdapter, Norms, Out
from headlab.models.hf.registry import register


@register
class GPTNeoXAdapter(HFAdapter):
    family = "gpt_neox"
    model_types = ("gpt_neox",)
    description = "GPT-NeoX (Pythia)"
    is_decoder = True
    attention = "attention"
    projections = Fused("query_key_value", "per_head")
    out = Out("attention.dense")

    @property
    def norms(self) -> Norms:  # type: ignore[override]  # read from the config: a property where other families declare a ClassVar
        if getattr(self.model.config, "use_parallel_residual", True):
            return Norms(pre="input_layernorm", kind="layernorm", parallel="mlp")
        return Norms(pre="input_layernorm", kind="layernorm")
