"""A Hugging Face family as one declaration: :class:`HFAdapter`.

A family says, in class attributes, where its blocks, attention modules and projections are; the
adapter derives the per-head views, the norm layout, physical head removal and the model's head
counts from them. Every transformers v5 family computes attention through the attention interface
(``ALL_ATTENTION_FUNCTIONS``), which headlab serves (:mod:`headlab.models.hf.attention_fn`), so a
decoder that uses the standard attention function is a declaration and nothing else::

    @register
    class LlamaAdapter(HFAdapter):
        family = "llama"
        model_types = ("llama", "mistral", ...)
        description = "Llama-style decoders"
        is_decoder = True
        layers = "layers"                          # blocks, from model.base_model
        attention = "self_attn"                    # from a block: the module calling the attention function
        projections = Separate("q_proj", "k_proj", "v_proj")   # from the attention module
        out = Out("self_attn.o_proj")              # W^O, from a block
        norms = Norms(pre="input_layernorm", kind="rmsnorm")

``head_attrs`` lists the attention module's attributes that hold head counts, which pruning updates
(``"H"``, ``"Hkv"``, ``"G"`` = H // Hkv, ``"H*d"``). See ``docs/adding-a-family.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from headlab.errors import ModelError
from headlab.models.base import ModelAdapter
from headlab.models.hf import attention_fn
from headlab.models.norm_layout import BlockNorms
from headlab.models.projections import Fused, Out, Separate, get_module


@dataclass(frozen=True)
class Norms:
    """A family's norm layout, as paths from a block (see :mod:`headlab.models.norm_layout`)."""

    pre: str | None = None
    post: str | None = None
    post_reads: Literal["sum", "branch"] = "sum"
    kind: Literal["layernorm", "rmsnorm"] = "layernorm"
    offset: float = 0.0
    parallel: str | None = None

    def resolve(self, block: nn.Module) -> BlockNorms:
        return BlockNorms(
            pre=get_module(block, self.pre) if self.pre else None,
            post=get_module(block, self.post) if self.post else None,
            post_reads=self.post_reads,
            kind=self.kind,
            offset=self.offset,
            parallel=get_module(block, self.parallel) if self.parallel else None,
        )


def _first(cfg, names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


class HFAdapter(ModelAdapter):
    """A Hugging Face family (see the module docstring for the declaration)."""

    model: Any  # a transformers PreTrainedModel: its config and methods are read by name, family by family
    model_types: ClassVar[tuple[str, ...]] = ()  # the config.model_type values this family adapts
    description: ClassVar[str] = ""  # how the support table and the unsupported-architecture message name it
    layers: ClassVar[str] = "layers"
    attention: ClassVar[str] = "self_attn"
    projections: ClassVar[Separate | Fused] = Separate()
    out: ClassVar[Out] = Out("self_attn.o_proj")
    norms: ClassVar[Norms] = Norms(pre="input_layernorm", kind="rmsnorm")
    head_attrs: ClassVar[dict[str, str]] = {}
    positions: ClassVar[str] = "rotary"  # how the family encodes positions: rotary, absolute, alibi, relative
    score_mods: ClassVar[str] = ""  # what the family does to its scores beyond the scale, for the support table
    stock_config: ClassVar[bool] = False  # a uniformly pruned model is a stock config (the config has head_dim)
    limits: ClassVar[dict[str, str]] = {}  # step -> caveat, for the support table (headlab models)

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self.blocks = list(self._blocks(model))
        H, Hkv, d, E = self.shape(cfg)
        super().__init__(
            model,
            n_layers=len(self.blocks),
            n_heads=H,
            n_kv_heads=Hkv,
            head_dim=d,
            d_model=E,
            attn_modules=[get_module(b, self.attention) for b in self.blocks],
            out_projs=[get_module(b, self.out.path) for b in self.blocks],
        )

    def _blocks(self, model: nn.Module):
        return get_module(model.base_model, self.layers)

    @classmethod
    def shape(cls, cfg) -> tuple[int, int, int, int]:
        """``(H, Hkv, d, E)`` from a config: query heads, kv heads, head size, residual width."""
        E = _first(cfg, ("hidden_size", "n_embd", "d_model", "dim"))
        H = _first(cfg, ("num_attention_heads", "n_head", "n_heads", "num_heads"))
        if E is None or H is None:
            raise ModelError(f"cannot read the width and heads of a {cfg.model_type} config")
        Hkv = _first(cfg, ("num_key_value_heads", "num_kv_heads"), H)
        d = getattr(cfg, "head_dim", None) or E // H
        return int(H), int(Hkv), int(d), int(E)

    @classmethod
    def max_positions(cls, config) -> int:
        n = _first(config, ("max_position_embeddings", "n_positions", "max_positions"))
        if n is None:
            raise ModelError(f"cannot tell the maximum positions of a {config.model_type} config")
        return int(n)

    # -- what the base adapter asks ---------------------------------------------------------------------------
    def attention_norm(self, layer: int) -> BlockNorms:
        return self.norms.resolve(self.blocks[self._check_layer(layer)])

    def _weights(self, layer, which):
        H, Hkv, d = self.layer_heads[layer], self.layer_kv_heads[layer], self.head_dim
        if which == "o":
            return self.out.weight(self.out_projs[layer], H, d)
        return self.projections.weight(self.attn_modules[layer], which, H, Hkv, d)

    def _bias(self, layer, which):
        if which == "o":
            return getattr(self.out_projs[layer], "bias", None)
        H, Hkv, d = self.layer_heads[layer], self.layer_kv_heads[layer], self.head_dim
        return self.projections.bias(self.attn_modules[layer], which, H, Hkv, d)

    # -- physical head removal (models.surgery calls these) --------------------------------------------------------
    def cut_heads(self, attn: nn.Module, out: nn.Module, q_heads, kv_heads, H: int, Hkv: int) -> None:
        """Keep query heads ``q_heads`` and kv heads ``kv_heads`` of one layer (counts ``H``, ``Hkv`` before), in place."""
        d = self.head_dim
        self.projections.cut(attn, q_heads, kv_heads, H, Hkv, d)
        self.out.cut(out, q_heads, d)
        values = {"H": len(q_heads), "Hkv": len(kv_heads), "G": len(q_heads) // len(kv_heads), "H*d": len(q_heads) * d}
        for attr, what in self.head_attrs.items():
            setattr(attn, attr, values[what])

    def zero_heads(self, out: nn.Module, local_heads, *, H: int) -> None:
        self.out.zero(out, local_heads, self.head_dim)

    def prune_config(self, config, H: int, Hkv: int) -> bool:
        """Write uniform head counts into the config when it can say them (True), so the pruned model saves as
        a stock Hugging Face folder."""
        if not self.stock_config:
            return False
        config.num_attention_heads, config.num_key_value_heads = H, Hkv
        config.head_dim = self.head_dim
        return True

    # -- the attention implementation -----------------------------------------------------------------------------
    def _enter_backend(self):
        """Switch the model to headlab's attention implementation with transformers' public API."""
        saved = self.model.config._attn_implementation
        if saved != attention_fn.IMPLEMENTATION:
            self.model.set_attn_implementation(attention_fn.IMPLEMENTATION)
        return saved

    def _exit_backend(self, saved) -> None:
        if saved != self.model.config._attn_implementation:
            self.model.set_attn_implementation(saved)


class OwnForwardAdapter(HFAdapter):
    """A family whose attention modules compute attention themselves instead of calling the attention
    interface (BLOOM, Falcon): headlab swaps in :meth:`attention_forward` on each module while a backend,
    an edit or a capture is active, and restores the module's own forward after."""

    def attention_forward(self, module: nn.Module, *args, **kwargs):  # pragma: no cover - every subclass has one
        raise NotImplementedError

    def _enter_backend(self):
        saved = []
        for am in self.attn_modules:
            saved.append(am.__dict__.get("forward"))
            am.forward = bound_forward(self.attention_forward, am)
        return saved

    def _exit_backend(self, saved) -> None:
        for am, f in zip(self.attn_modules, saved):
            if f is None:
                am.__dict__.pop("forward", None)
            else:
                am.forward = f


def bound_forward(fn, module):
    """``fn(module, ...)`` as a forward to set on ``module`` (an instance attribute replaces the class's)."""

    def forward(*args, **kwargs):
        return fn(module, *args, **kwargs)

    return forward


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, L, d)`` -> ``(B, L, H*d)``."""
    B, H, L, d = x.shape
    return x.transpose(1, 2).reshape(B, L, H * d)


__all__ = ["Fused", "HFAdapter", "Norms", "Out", "OwnForwardAdapter", "Separate", "bound_forward", "merge_heads"]
