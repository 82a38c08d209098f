"""BERT-style encoders: BERT (MiniLM is one), RoBERTa, XLM-RoBERTa, ELECTRA, and their task heads."""

from __future__ import annotations

from headlab.models.hf.family import HFAdapter, Norms, Out, Separate
from headlab.models.hf.registry import register


@register
class BertAdapter(HFAdapter):
    """``encoder.layer[l].attention.self`` (query, key, value) and ``attention.output.dense`` (W^O); post-LN."""

    family = "bert"
    model_types = ("bert", "roberta", "xlm-roberta", "electra")
    description = "BERT-style encoders (MiniLM, BERT, RoBERTa, XLM-RoBERTa, ELECTRA)"
    layers = "encoder.layer"
    attention = "attention.self"
    projections = Separate("query", "key", "value")
    out = Out("attention.output.dense")
    norms = Norms(post="attention.output.LayerNorm", kind="layernorm")
    positions = "absolute"

    @classmethod
    def max_positions(cls, config) -> int:
        n = int(config.max_position_embeddings)
        if config.model_type in ("roberta", "xlm-roberta"):  # RoBERTa reserves pad_token_id + 1 position slots
            n -= (config.pad_token_id or 0) + 1
        return n
