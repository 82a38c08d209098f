"""Falcon: a fused ``query_key_value`` (grouped ``(Hkv, G + 2, d)`` in the new decoder architecture,
[Q | K | V] with one kv head for multi-query, per head otherwise), rotary positions or ALiBi, attention and
MLP in parallel, and an attention module that computes attention itself (no attention interface)."""

from __future__ import annotations

from headlab.models.hf.attention_fn import hf_mask_and_bias, hf_mask_to_bool
from headlab.models.hf.family import Fused, Norms, Out, OwnForwardAdapter, merge_heads
from headlab.models.hf.registry import register
from headlab.models.sites import run_attention
from headlab.spec.score_mods import bias_tensor


@register
class FalconAdapter(OwnForwardAdapter):
    family = "falcon"
    model_types = ("falcon",)
    description = "Falcon"
    is_decoder = True
    layers = "h"
    attention = "self_attention"
    out = Out("self_attention.dense")
    head_attrs = {"num_heads": "H", "num_kv_heads": "Hkv"}
    score_mods = "ALiBi in the ALiBi variants"
    limits = {
        "backends": "sdpa refused for ALiBi variants",
        "pruning": "rotary variants only",
        "norms": "stream=False for ALiBi variants",
    }

    @classmethod
    def shape(cls, cfg):
        H, E = cfg.num_attention_heads, cfg.hidden_size
        Hkv = cfg.num_kv_heads if cfg.new_decoder_architecture else (1 if cfg.multi_query else H)
        return H, Hkv, E // H, E

    @property
    def projections(self):
        cfg = self.model.config
        if cfg.new_decoder_architecture:
            return Fused("query_key_value", "grouped")
        return Fused("query_key_value", "blocks" if cfg.multi_query else "per_head")

    @property
    def norms(self) -> Norms:  # type: ignore[override]  # read from the config: a property where other families declare a ClassVar
        cfg = self.model.config
        pre = "ln_attn" if cfg.new_decoder_architecture and cfg.num_ln_in_parallel_attn == 2 else "input_layernorm"
        if cfg.new_decoder_architecture or cfg.parallel_attn:
            return Norms(pre=pre, kind="layernorm", parallel="mlp")
        return Norms(pre=pre, kind="layernorm")

    @property
    def positions(self) -> str:  # type: ignore[override]  # read from the config, as norms
        return "alibi" if self.model.config.alibi else "rotary"

    def cut_heads(self, attn, out, q_heads, kv_heads, H, Hkv):
        if self.model.config.alibi:
            from headlab.errors import PruneError

            raise PruneError(
                "Falcon with ALiBi builds its bias rows for every original head; pruning its heads is "
                "not supported (the rotary Falcon models prune)"
            )
        super().cut_heads(attn, out, q_heads, kv_heads, H, Hkv)

    def attention_forward(self, module, hidden_states, *args, **kwargs):
        """Bound to the installed transformers' own signature: up to 5.24 the model passes ``alibi``; from 5.25
        it folds ALiBi (already scaled) into an additive ``attention_mask`` and passes no ``alibi``."""
        import inspect

        from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

        bound = inspect.signature(type(module).forward).bind(module, hidden_states, *args, **kwargs)
        bound.apply_defaults()
        a = {**bound.arguments, **bound.arguments.get("kwargs", {})}
        alibi, attention_mask, layer_past = a.get("alibi"), a.get("attention_mask"), a.get("layer_past")
        output_attentions, position_embeddings = a.get("output_attentions", False), a.get("position_embeddings")

        B, L, _ = hidden_states.shape
        H, Hkv, d = module.num_heads, module.num_kv_heads, module.head_dim
        fused = module.query_key_value(hidden_states)
        cfg = self.model.config
        if cfg.new_decoder_architecture:  # (B, L, Hkv, G + 2, d)
            qkv = fused.view(B, L, Hkv, H // Hkv + 2, d)
            q = qkv[:, :, :, :-2].reshape(B, L, H, d)
            k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # (B, L, Hkv, d)
        elif cfg.multi_query:
            q = fused[..., : H * d].view(B, L, H, d)
            k, v = fused[..., H * d : (H + 1) * d].view(B, L, 1, d), fused[..., (H + 1) * d :].view(B, L, 1, d)
        else:
            qkv = fused.view(B, L, H, 3, d)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, L, d)
        extra = None
        if not cfg.alibi:
            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if layer_past is not None:
            k, v = layer_past.update(k, v, module.layer_idx)
        if alibi is not None:  # Falcon scales the ALiBi rows together with the scores
            rows = alibi.view(B, H, 1, -1)[..., -k.shape[2] :] * module.inv_norm_factor
            extra = {"score_mod": bias_tensor(rows, "alibi")}
        if alibi is None and cfg.alibi:  # transformers >= 5.25: the scaled ALiBi rows ride in the additive mask
            mask, bias = hf_mask_and_bias(attention_mask)
            extra = None if bias is None else {"score_mod": bias_tensor(bias, "alibi")}
        else:
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
            score_kwargs=extra,
        )
        return module.dense(merge_heads(out)), weights
