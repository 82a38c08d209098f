"""GPT-2 (``GPT2Model``, ``GPT2LMHeadModel``): a fused ``c_attn`` Conv1D ``(E, 3E)`` = [W_Q | W_K | W_V]."""

from __future__ import annotations

from torch import nn

from headlab.models.hf.common import HFAdapter, register


@register
class GPT2Adapter(HFAdapter):
    """``h.attn`` (``c_attn`` fused Conv1D) and ``h.attn.c_proj`` (W^O, Conv1D ``(H*d, E)``)."""

    family = "gpt2"
    model_types = ("gpt2",)
    description = "GPT-2"
    is_decoder = True

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        blocks = model.base_model.h
        H = cfg.num_attention_heads
        super().__init__(model, n_layers=len(blocks), n_heads=H, n_kv_heads=H, head_dim=cfg.hidden_size // H,
                         d_model=cfg.hidden_size, attn_modules=[b.attn for b in blocks],
                         out_projs=[b.attn.c_proj for b in blocks])

    def attention_norm(self, layer):
        return "pre", self.model.base_model.h[self._check_layer(layer)].ln_1, "layernorm"

    def _weights(self, layer, which):
        E, H, d = self.d_model, self.n_heads, self.head_dim
        if which == "o":
            return self.out_projs[layer].weight.view(H, d, E)  # Conv1D weight (H*d, E)
        i = "qkv".index(which)
        w = self.attn_modules[layer].c_attn.weight[:, i * E:(i + 1) * E]  # (E, H*d)
        return w.view(E, H, d).transpose(0, 1)  # (H, E, d)

    def _bias(self, layer, which):
        E, H, d = self.d_model, self.n_heads, self.head_dim
        if which == "o":
            return self.out_projs[layer].bias
        i = "qkv".index(which)
        return self.attn_modules[layer].c_attn.bias[i * E:(i + 1) * E].view(H, d)
