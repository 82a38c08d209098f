"""BLOOM: a fused ``query_key_value`` laid out per head ``(H, 3, d)``, ALiBi, and an attention module that
computes attention itself (it does not call transformers' attention interface).

headlab runs BLOOM's attention through :func:`~headlab.models.sites.run_attention` with the model's own ALiBi
rows as an additive score modification (:func:`headlab.masks.bias_tensor`), applied by the reference,
tiled and sparse backends; sdpa cannot add a score modification and is refused with a typed error.
"""

from __future__ import annotations

import torch.nn.functional as F

from headlab.models.hf.attention_fn import hf_mask_to_bool
from headlab.models.hf.family import Fused, Norms, Out, OwnForwardAdapter, bound_forward, merge_heads
from headlab.models.hf.registry import register
from headlab.models.sites import run_attention
from headlab.spec.score_mods import bias_tensor


@register
class BloomAdapter(OwnForwardAdapter):
    family = "bloom"
    model_types = ("bloom",)
    description = "BLOOM"
    is_decoder = True
    layers = "h"
    attention = "self_attention"
    projections = Fused("query_key_value", "per_head")
    out = Out("self_attention.dense")
    norms = Norms(pre="input_layernorm", kind="layernorm")
    head_attrs = {"num_heads": "H"}
    positions = "alibi"
    score_mods = "ALiBi (an additive bias from the model's own rows)"
    limits = {"backends": "sdpa refused (it cannot add ALiBi)", "norms": "stream=False (map-free tiles add no ALiBi)"}

    @classmethod
    def max_positions(cls, config) -> int:  # ALiBi has no table; BLOOM was trained on 2,048 tokens
        return int(getattr(config, "seq_length", None) or 2048)

    def cut_heads(self, attn, out, q_heads, kv_heads, H, Hkv):
        super().cut_heads(attn, out, q_heads, kv_heads, H, Hkv)
        # the model builds ALiBi rows for all of its original heads: remember which ones this layer keeps, and
        # run headlab's forward from now on (BLOOM's own would add every head's rows)
        before = getattr(attn, "_headlab_alibi_heads", list(range(H)))
        attn._headlab_alibi_heads = [before[h] for h in q_heads]
        attn.forward = bound_forward(self.attention_forward, attn)

    def attention_forward(
        self,
        module,
        hidden_states,
        residual,
        alibi,
        attention_mask,
        layer_past=None,
        use_cache=False,
        output_attentions=False,
        **kwargs,
    ):
        B, L, _ = hidden_states.shape
        q, k, v = module._reshape(module.query_key_value(hidden_states))  # (B, H, L, d) each
        if layer_past is not None:
            k, v = layer_past.update(k, v, module.layer_idx)
        Lk = k.shape[2]
        rows = alibi.view(B, -1, 1, alibi.shape[-1])[..., -Lk:]  # (B, H_model, 1, Lk)
        kept = getattr(module, "_headlab_alibi_heads", None)
        if kept is not None:
            rows = rows[:, kept]
        mask = hf_mask_to_bool(attention_mask)
        out, weights = run_attention(
            module,
            q,
            k,
            v,
            mask,
            causal=mask is None and L > 1,
            scale=module.inv_norm_factor,
            dropout_p=module.attention_dropout.p if module.training else 0.0,
            need_weights=output_attentions,
            score_kwargs={"score_mod": bias_tensor(rows, "alibi")},
        )
        output = module.dense(merge_heads(out))
        output = residual + F.dropout(output, p=module.hidden_dropout, training=module.training)
        return output, weights
