"""EuroBERT: a Llama-style encoder (``layers[l].self_attn`` with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
pre-RMSNorm, rotary positions, grouped-query attention) that attends both ways.

Declared rather than read by structure because transformers has a tensor-parallel plan for it: a declared family
takes its heads from the config, so a rank's ``H / world`` heads are read as its share of ``H``
(:mod:`headlab.models.tensor_parallel`), where discovery by structure would take them for all of them.
"""

from __future__ import annotations

from headlab.models.hf.family import HFAdapter
from headlab.models.hf.registry import register


@register
class EuroBertAdapter(HFAdapter):
    family = "eurobert"
    model_types = ("eurobert",)
    description = "EuroBERT, a Llama-style bidirectional encoder"
    head_attrs = {"num_key_value_groups": "G"}
