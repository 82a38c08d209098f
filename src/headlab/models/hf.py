"""Adapters for Hugging Face transformers v5 families.

=========  ==================================  ==========================  =======================
family     model types                         attention / W^O              q, k, v weights
=========  ==================================  ==========================  =======================
bert       bert (MiniLM), roberta              layer.attention.self /       query, key, value
                                               layer.attention.output.dense (nn.Linear)
gpt2       gpt2                                h.attn / h.attn.c_proj       c_attn (Conv1D, fused)
llama      llama, mistral, qwen2 (GQA)         layers.self_attn / o_proj    q_proj, k_proj, v_proj
=========  ==================================  ==========================  =======================

``nn.Linear`` stores ``weight (out, in)`` and computes ``x @ weight.T``; GPT-2's ``Conv1D`` stores
``weight (in, out)`` and computes ``x @ weight``. The per-head views below are views: editing them
edits the model.
"""

from __future__ import annotations

import torch
from torch import nn

from headlab.errors import UnsupportedArchitectureError
from headlab.models import hf_backend
from headlab.models.base import ModelAdapter

FAMILIES: dict[str, tuple[str, ...]] = {
    "bert": ("bert", "roberta"),
    "gpt2": ("gpt2",),
    "llama": ("llama", "mistral", "qwen2"),
}


def supported_model_types() -> list[str]:
    return [t for types in FAMILIES.values() for t in types]


def _split_linear_in(weight: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """``nn.Linear(E -> heads*d).weight (heads*d, E)`` as ``(heads, E, d)``."""
    return weight.view(heads, d, weight.shape[1]).transpose(1, 2)


def _split_linear_out(weight: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """``nn.Linear(heads*d -> E).weight (E, heads*d)`` as ``(heads, d, E)``."""
    return weight.t().view(heads, d, weight.shape[0])


class HFAdapter(ModelAdapter):
    """Shared by the Hugging Face families: switching the attention implementation."""

    def _enter_backend(self):
        configs = {}
        for m in [self.model, *self.model.modules()]:
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation_internal"):
                configs[id(cfg)] = cfg
        saved = [(cfg, cfg._attn_implementation_internal) for cfg in configs.values()]
        for cfg in configs.values():
            cfg._attn_implementation_internal = hf_backend.IMPLEMENTATION
        return saved

    def _exit_backend(self, saved) -> None:
        for cfg, impl in reversed(saved):
            cfg._attn_implementation_internal = impl


class BertAdapter(HFAdapter):
    """BERT-style encoders: ``BertModel`` (MiniLM is one), ``RobertaModel`` and their task heads."""

    family = "bert"

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        layers = model.base_model.encoder.layer
        H = cfg.num_attention_heads
        super().__init__(model, n_layers=len(layers), n_heads=H, n_kv_heads=H, head_dim=cfg.hidden_size // H,
                         d_model=cfg.hidden_size, attn_modules=[l.attention.self for l in layers],
                         out_projs=[l.attention.output.dense for l in layers])

    def _weights(self, layer, which):
        if which == "o":
            return _split_linear_out(self.out_projs[layer].weight, self.n_heads, self.head_dim)
        lin = getattr(self.attn_modules[layer], {"q": "query", "k": "key", "v": "value"}[which])
        return _split_linear_in(lin.weight, self.n_heads, self.head_dim)

    def _bias(self, layer, which):
        if which == "o":
            return self.out_projs[layer].bias
        lin = getattr(self.attn_modules[layer], {"q": "query", "k": "key", "v": "value"}[which])
        return None if lin.bias is None else lin.bias.view(self.n_heads, self.head_dim)


class GPT2Adapter(HFAdapter):
    """GPT-2 (``GPT2Model``, ``GPT2LMHeadModel``): fused ``c_attn`` Conv1D ``(E, 3E)`` = [W_Q | W_K | W_V]."""

    family = "gpt2"

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        blocks = model.base_model.h
        H = cfg.num_attention_heads
        super().__init__(model, n_layers=len(blocks), n_heads=H, n_kv_heads=H, head_dim=cfg.hidden_size // H,
                         d_model=cfg.hidden_size, attn_modules=[b.attn for b in blocks],
                         out_projs=[b.attn.c_proj for b in blocks])

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


class LlamaAdapter(HFAdapter):
    """Llama-style decoders with grouped-query attention: Llama, Mistral, Qwen2.

    The q and k sites hold queries and keys *after* the rotary embedding (what the scores see), so
    ``x @ W_Q[h] + b_Q[h]`` equals the captured q only before RoPE.
    """

    family = "llama"

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        layers = model.base_model.layers
        H = cfg.num_attention_heads
        Hkv = getattr(cfg, "num_key_value_heads", None) or H
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
        super().__init__(model, n_layers=len(layers), n_heads=H, n_kv_heads=Hkv, head_dim=d,
                         d_model=cfg.hidden_size, attn_modules=[l.self_attn for l in layers],
                         out_projs=[l.self_attn.o_proj for l in layers])

    def _weights(self, layer, which):
        am = self.attn_modules[layer]
        if which == "o":
            return _split_linear_out(am.o_proj.weight, self.n_heads, self.head_dim)
        heads = self.n_heads if which == "q" else self.n_kv_heads
        return _split_linear_in(getattr(am, f"{which}_proj").weight, heads, self.head_dim)

    def _bias(self, layer, which):
        am = self.attn_modules[layer]
        lin = am.o_proj if which == "o" else getattr(am, f"{which}_proj")
        if lin.bias is None or which == "o":
            return lin.bias
        heads = self.n_heads if which == "q" else self.n_kv_heads
        return lin.bias.view(heads, self.head_dim)


_BY_TYPE = {t: cls for cls, fam in ((BertAdapter, "bert"), (GPT2Adapter, "gpt2"), (LlamaAdapter, "llama"))
            for t in FAMILIES[fam]}


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter of a Hugging Face model, by ``config.model_type``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    cls = _BY_TYPE.get(model_type)
    if cls is None:
        raise UnsupportedArchitectureError(unsupported_message(model_type or type(model).__name__))
    return cls(model)


def unsupported_message(what: str) -> str:
    return (f"no headlab adapter for {what!r}; supported families: BERT-style encoders (bert, roberta, MiniLM), "
            "GPT-2 (gpt2), Llama-style decoders (llama, mistral, qwen2), and headlab's own Transformer")
