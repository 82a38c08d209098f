"""BERT-style encoders: ``BertModel`` (MiniLM is one), ``RobertaModel`` and their task heads."""

from __future__ import annotations

from torch import nn

from headlab.models.hf.common import HFAdapter, register, split_linear_in, split_linear_out

_QKV = {"q": "query", "k": "key", "v": "value"}


@register
class BertAdapter(HFAdapter):
    """``layer.attention.self`` (query, key, value ``nn.Linear``) and ``layer.attention.output.dense`` (W^O)."""

    family = "bert"
    model_types = ("bert", "roberta")
    description = "BERT-style encoders (MiniLM, BERT, RoBERTa)"

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        layers = model.base_model.encoder.layer
        H = cfg.num_attention_heads
        super().__init__(model, n_layers=len(layers), n_heads=H, n_kv_heads=H, head_dim=cfg.hidden_size // H,
                         d_model=cfg.hidden_size, attn_modules=[l.attention.self for l in layers],
                         out_projs=[l.attention.output.dense for l in layers])

    @classmethod
    def max_positions(cls, config) -> int:
        n = int(config.max_position_embeddings)
        if config.model_type == "roberta":  # RoBERTa reserves pad_token_id + 1 position slots
            n -= (config.pad_token_id or 0) + 1
        return n

    def attention_norm(self, layer):
        return "post", self.model.base_model.encoder.layer[self._check_layer(layer)].attention.output.LayerNorm, "layernorm"

    def _weights(self, layer, which):
        if which == "o":
            return split_linear_out(self.out_projs[layer].weight, self.n_heads, self.head_dim)
        return split_linear_in(getattr(self.attn_modules[layer], _QKV[which]).weight, self.n_heads, self.head_dim)

    def _bias(self, layer, which):
        if which == "o":
            return self.out_projs[layer].bias
        lin = getattr(self.attn_modules[layer], _QKV[which])
        return None if lin.bias is None else lin.bias.view(self.n_heads, self.head_dim)
