"""Encoder-decoders: three stacks of attention layers, and one declaration per family.

An encoder-decoder has encoder self-attention, decoder self-attention and the decoder's cross-attention
over the encoder's output. The adapter lists them in that order as one sequence of attention layers
(gates, importance and pruning are indexed over it) and names their sites by stack:
``encoder.{l}.attn.{kind}``, ``decoder.{l}.attn.{kind}``, ``decoder.{l}.cross.{kind}``
(:attr:`~headlab.models.base.ModelAdapter.stacks` gives each stack's indices).

What is specific to cross-attention: its values are computed from the encoder's output (the
``key_value_states`` the module is called with), so value-aware norms read that; its residual belongs to
the decoder token, not to any key, so residual-mode norms leave it out (asked for by index, it is refused with
that reason; over the whole model the self-attention layers answer and a note says so); and rollout runs per stack
(Abnar and Zuidema's definition within the encoder, and within the decoder's self-attention).
"""

from __future__ import annotations

from typing import Any, ClassVar

from headlab.errors import ConfigError
from headlab.models.hf.family import HFAdapter, Norms
from headlab.models.hf.registry import register
from headlab.models.norm_layout import BlockNorms
from headlab.models.projections import Out, Separate, get_module


class EncoderDecoderAdapter(HFAdapter):
    """The declaration of an encoder-decoder: block lists, and per stack its attention, W^O and norms."""

    encoder_layers: ClassVar[str] = "encoder.layers"  # from model.base_model
    decoder_layers: ClassVar[str] = "decoder.layers"
    decoder_attention: ClassVar[str] = "self_attn"  # from a decoder block
    cross: ClassVar[str] = "encoder_attn"
    decoder_out: ClassVar[Out] = Out("self_attn.out_proj")
    cross_out: ClassVar[Out] = Out("encoder_attn.out_proj")
    decoder_norms: ClassVar[Norms] = Norms()
    cross_norms: ClassVar[Norms] = Norms()

    def __init__(self, model: Any) -> None:  # a transformers encoder-decoder
        root = model.base_model
        self.encoder_blocks = list(get_module(root, self.encoder_layers))
        self.decoder_blocks = list(get_module(root, self.decoder_layers))
        self._Le, self._Ld = len(self.encoder_blocks), len(self.decoder_blocks)
        H, Hkv, d, E = self.shape(model.config)
        attn = (
            [get_module(b, self.attention) for b in self.encoder_blocks]
            + [get_module(b, self.decoder_attention) for b in self.decoder_blocks]
            + [get_module(b, self.cross) for b in self.decoder_blocks]
        )
        outs = (
            [get_module(b, self.out.path) for b in self.encoder_blocks]
            + [get_module(b, self.decoder_out.path) for b in self.decoder_blocks]
            + [get_module(b, self.cross_out.path) for b in self.decoder_blocks]
        )
        self.blocks = self.encoder_blocks + self.decoder_blocks + self.decoder_blocks
        super(HFAdapter, self).__init__(
            model,
            n_layers=len(attn),
            n_heads=H,
            n_kv_heads=Hkv,
            head_dim=d,
            d_model=E,
            attn_modules=attn,
            out_projs=outs,
        )

    def _site_prefixes(self) -> list[str]:
        Le, Ld = self._Le, self._Ld
        return (
            [f"encoder.{l}.attn" for l in range(Le)]
            + [f"decoder.{l}.attn" for l in range(Ld)]
            + [f"decoder.{l}.cross" for l in range(Ld)]
        )

    @property
    def stacks(self) -> dict[str, list[int]]:
        Le, Ld = self._Le, self._Ld
        return {
            "encoder": list(range(Le)),
            "decoder": list(range(Le, Le + Ld)),
            "cross": list(range(Le + Ld, Le + 2 * Ld)),
        }

    def stack_of(self, layer: int) -> str:
        return next(s for s, ids in self.stacks.items() if layer in ids)

    def is_cross(self, layer: int) -> bool:
        return self.stack_of(layer) == "cross"

    def value_input(self, layer: int, args, kwargs):
        if self.is_cross(layer):  # cross-attention reads its keys and values from the encoder's output
            for name in ("key_value_states", "encoder_hidden_states"):  # T5's name, UMT5's
                if kwargs.get(name) is not None:
                    return kwargs[name]
            return args[1] if len(args) > 1 else None
        return super().value_input(layer, args, kwargs)

    def attention_norm(self, layer: int) -> BlockNorms:
        stack = self.stack_of(self._check_layer(layer))
        if stack == "cross":
            raise ConfigError(
                f"layer {layer} ({self.site_prefixes[layer]}) is cross-attention: its residual belongs to the decoder "
                "token, not to any of the keys, so the residual-mode decomposition does not apply; use "
                "mode='attention'"
            )
        norms = self.norms if stack == "encoder" else self.decoder_norms
        return norms.resolve(self.blocks[layer])


@register
class BartAdapter(EncoderDecoderAdapter):
    family = "bart"
    model_types = ("bart",)
    description = "BART (encoder-decoder)"
    attention = "self_attn"
    projections = Separate()
    out = Out("self_attn.out_proj")
    norms = Norms(post="self_attn_layer_norm", kind="layernorm")
    decoder_norms = Norms(post="self_attn_layer_norm", kind="layernorm")
    positions = "absolute"


@register
class WhisperAdapter(EncoderDecoderAdapter):
    family = "whisper"
    model_types = ("whisper",)
    description = "Whisper (encoder-decoder over audio features)"
    attention = "self_attn"
    projections = Separate()
    out = Out("self_attn.out_proj")
    norms = Norms(pre="self_attn_layer_norm", kind="layernorm")
    decoder_norms = Norms(pre="self_attn_layer_norm", kind="layernorm")
    head_attrs = {"num_heads": "H"}
    positions = "absolute"

    @classmethod
    def max_positions(cls, config) -> int:
        return int(config.max_target_positions)


@register
class T5Adapter(EncoderDecoderAdapter):
    """T5: no scaling of the scores, a learned bucketed relative bias computed by each stack's first layer and
    passed to the others (headlab adds it as a score modification: :func:`headlab.masks.bias_tensor`)."""

    family = "t5"
    model_types = ("t5",)
    description = "T5 (encoder-decoder, relative position bias)"
    encoder_layers = "encoder.block"
    decoder_layers = "decoder.block"
    attention = "layer.0.SelfAttention"
    decoder_attention = "layer.0.SelfAttention"
    cross = "layer.1.EncDecAttention"
    projections = Separate("q", "k", "v")
    out = Out("layer.0.SelfAttention.o")
    decoder_out = Out("layer.0.SelfAttention.o")
    cross_out = Out("layer.1.EncDecAttention.o")
    norms = Norms(pre="layer.0.layer_norm", kind="rmsnorm")
    decoder_norms = Norms(pre="layer.0.layer_norm", kind="rmsnorm")
    head_attrs = {"n_heads": "H", "inner_dim": "H*d"}
    positions = "relative"
    score_mods = "relative position bias (bucketed, learned)"
    limits = {
        "backends": "sdpa refused on layers with a relative bias",
        "norms": "stream=False (map-free tiles add no relative bias)",
    }

    @classmethod
    def shape(cls, cfg):
        return cfg.num_heads, cfg.num_heads, cfg.d_kv, cfg.d_model

    @classmethod
    def max_positions(cls, config) -> int:  # relative positions: no table; T5 was trained on 512 tokens
        return int(getattr(config, "n_positions", None) or 512)

    def cut_heads(self, attn, out, q_heads, kv_heads, H, Hkv):
        super().cut_heads(attn, out, q_heads, kv_heads, H, Hkv)
        # the stack's first layer computes the bias for every original head and hands it to the others: each
        # pruned layer keeps the rows of its own heads, which only headlab's attention function selects
        before = getattr(attn, "_headlab_bias_heads", list(range(H)))
        attn._headlab_bias_heads = [before[h] for h in q_heads]
        attn.config._attn_implementation = "headlab"
