"""Llama-style decoders with grouped-query attention: Llama (SmolLM2 is one), Mistral, Qwen2, Gemma 2."""

from __future__ import annotations

from torch import nn

from headlab.models.hf.common import HFAdapter, register, split_linear_in, split_linear_out


@register
class LlamaAdapter(HFAdapter):
    """``layers.self_attn`` (q_proj, k_proj, v_proj) and ``self_attn.o_proj`` (W^O).

    The q and k sites hold queries and keys *after* the rotary embedding (what the scores see), so
    ``x @ W_Q[h] + b_Q[h]`` equals the captured q only before RoPE.
    """

    family = "llama"
    model_types = ("llama", "mistral", "qwen2", "gemma2")
    description = "Llama-style decoders with grouped-query attention"
    is_decoder = True

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        layers = model.base_model.layers
        H = cfg.num_attention_heads
        Hkv = getattr(cfg, "num_key_value_heads", None) or H
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
        super().__init__(model, n_layers=len(layers), n_heads=H, n_kv_heads=Hkv, head_dim=d,
                         d_model=cfg.hidden_size, attn_modules=[l.self_attn for l in layers],
                         out_projs=[l.self_attn.o_proj for l in layers])

    def attention_norm(self, layer):
        return "pre", self.model.base_model.layers[self._check_layer(layer)].input_layernorm, "rmsnorm"

    def _weights(self, layer, which):
        am = self.attn_modules[layer]
        if which == "o":
            return split_linear_out(am.o_proj.weight, self.n_heads, self.head_dim)
        heads = self.n_heads if which == "q" else self.n_kv_heads
        return split_linear_in(getattr(am, f"{which}_proj").weight, heads, self.head_dim)

    def _bias(self, layer, which):
        am = self.attn_modules[layer]
        lin = am.o_proj if which == "o" else getattr(am, f"{which}_proj")
        if lin.bias is None or which == "o":
            return lin.bias
        heads = self.n_heads if which == "q" else self.n_kv_heads
        return lin.bias.view(heads, self.head_dim)
