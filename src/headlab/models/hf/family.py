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

from headlab.errors import ModelError, UnsupportedArchitectureError
from headlab.models.base import ModelAdapter
from headlab.models.hf import attention_fn
from headlab.models.norm_layout import BlockNorms
from headlab.models.projections import Fused, Out, Separate, get_module


@dataclass(frozen=True)
class Norms:
    """A family's norm layout, as paths from a block (see :mod:`headlab.models.norm_layout`). ``branch_scale``:
    the attribute path, from a block, of what scales the attention's output before the block reads it (a
    LayerScale vector, ``"layer_scale1.lambda1"``; a number, ``"residual_multiplier"``)."""

    pre: str | None = None
    post: str | None = None
    post_reads: Literal["sum", "branch"] = "sum"
    kind: Literal["layernorm", "rmsnorm"] = "layernorm"
    offset: float = 0.0
    parallel: str | None = None
    branch_scale: str | None = None

    def resolve(self, block: nn.Module) -> BlockNorms:
        return BlockNorms(
            pre=get_module(block, self.pre) if self.pre else None,
            post=get_module(block, self.post) if self.post else None,
            post_reads=self.post_reads,
            kind=self.kind,
            offset=self.offset,
            parallel=get_module(block, self.parallel) if self.parallel else None,
            branch_scale=_scale_at(block, self.branch_scale) if self.branch_scale else None,
        )


def _scale_at(block: nn.Module, path: str) -> torch.Tensor | float:
    """The branch scale at attribute ``path`` from ``block``: a tensor (the model's own, live) or a number."""
    v: Any = block
    for part in path.split("."):
        v = getattr(v, part, None)
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    raise ModelError(
        f"the branch scale {path!r} of a {type(block).__name__} is {type(v).__name__}, not a tensor or a number"
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
    # a norm the values pass through after W_V, acting on each head's d features (Gemma 3n's v_norm), as a path from
    # the attention module: the values are then not x W_V, so W_V and b_V are refused (value_projection gives them)
    value_norm: ClassVar[str | None] = None

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
        self._no_value_norm(which)
        return self.projections.weight(self.attn_modules[layer], which, H, Hkv, d)

    def _bias(self, layer, which):
        if which == "o":
            return getattr(self.out_projs[layer], "bias", None)
        self._no_value_norm(which)
        H, Hkv, d = self.layer_heads[layer], self.layer_kv_heads[layer], self.head_dim
        return self.projections.bias(self.attn_modules[layer], which, H, Hkv, d)

    def _no_value_norm(self, which: str) -> None:
        if which == "v" and self.value_norm:
            raise UnsupportedArchitectureError(
                f"the {self.family!r} values pass through the value norm {self.value_norm!r} after W_V, so they are "
                "not a linear map of the stream: W_V, b_V and what is built on them (value-aware norms, OV circuits, "
                "the atlas's copying scores) are not defined; captures, gates, backends, statistics, rollout, "
                "importance and pruning serve (adapter.value_projection(layer) gives the projection before the norm)"
            )

    def value_projection(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(W, b)`` of the value projection, ``(Hkv, E, d)`` and ``(Hkv, d)`` or None, before any value norm
        (the values are ``value_norm_module(layer)(x W + b)`` per head)."""
        layer = self._check_layer(layer)
        H, Hkv, d = self.layer_heads[layer], self.layer_kv_heads[layer], self.head_dim
        am = self.attn_modules[layer]
        return self.projections.weight(am, "v", H, Hkv, d), self.projections.bias(am, "v", H, Hkv, d)

    def value_norm_module(self, layer: int) -> nn.Module | None:
        """The value norm of layer ``layer`` (None without one)."""
        return get_module(self.attn_modules[self._check_layer(layer)], self.value_norm) if self.value_norm else None

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
        """Switch the model to headlab's attention implementation with transformers' public API (a model whose
        modules compute attention with their own math: its bridge, :mod:`headlab.models.hf.own_bridge`)."""
        from headlab.models.hf.own_state import bridge_of, set_implementation

        if bridge_of(self.model) is not None:
            return ("own", set_implementation(self.model, attention_fn.IMPLEMENTATION))
        saved = self.model.config._attn_implementation
        if saved != attention_fn.IMPLEMENTATION:
            self.model.set_attn_implementation(attention_fn.IMPLEMENTATION)
            if self.model.config._attn_implementation != attention_fn.IMPLEMENTATION:  # transformers refused, logging
                raise UnsupportedArchitectureError(
                    f"transformers keeps {type(self.model).__name__} on its {saved!r} attention (the file defining "
                    "the class has hand-written attention classes and never calls "
                    "ALL_ATTENTION_FUNCTIONS.get_interface, so _can_set_attn_implementation() is False); headlab's "
                    "backends, gates and captures would not run. Set "
                    f"{type(self.model).__name__}._can_set_attn_implementation = classmethod(lambda cls: True) "
                    "before adapting, or call the interface in the modelling file"
                )
        return saved

    def _exit_backend(self, saved) -> None:
        if isinstance(saved, tuple) and saved[:1] == ("own",):
            from headlab.models.hf.own_state import set_implementation

            set_implementation(self.model, saved[1] or "eager")
            return
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
