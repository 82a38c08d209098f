"""Where each family keeps its layer norms, and whether it is causal: the one place flow/ looks
past the adapter into a model's own modules.

    ======== ============================ =========================================================
    family   block layout                 norm module read here (layer ``l``)
    ======== ============================ =========================================================
    bert     post-LN: LN(x + Attn(x))     ``base_model.encoder.layer[l].attention.output.LayerNorm``
    gpt2     pre-LN:  x + Attn(LN(x))     ``base_model.h[l].ln_1``
    llama    pre-RMSNorm: x + Attn(N(x))  ``base_model.layers[l].input_layernorm``
    headlab  pre-LN:  x + Attn(LN(x))     ``blocks[l].ln1``
    ======== ============================ =========================================================

:func:`layer_norms` is meant to become an adapter method (``adapter.layer_norm(l)``) once the model
registry has one; until then it is the only function in this room that reads ``adapter.model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from headlab.errors import UnsupportedArchitectureError

SUPPORTED_FAMILIES = ("bert", "gpt2", "llama", "headlab")


@dataclass(frozen=True)
class BlockNorms:
    """The norm around one attention layer.

    ``layout="post"``: the norm reads ``x + Attn(x) + b_O`` (BERT); ``layout="pre"``: the norm makes
    the attention's input from the residual stream ``x``, and the block adds ``x + Attn(norm(x))``.
    """

    layout: Literal["pre", "post"]
    norm: nn.Module  # nn.LayerNorm or an RMSNorm (weight, eps / variance_epsilon)
    kind: Literal["layernorm", "rmsnorm"]


def layer_norms(adapter, layer: int) -> BlockNorms:
    """The norm module of block ``layer`` of ``adapter``'s model (see the table in the module docstring).

    Raises :class:`~headlab.errors.UnsupportedArchitectureError` for another family, naming the supported ones.
    """
    family = getattr(adapter, "family", "?")
    model = adapter.model
    if family == "bert":
        return BlockNorms("post", model.base_model.encoder.layer[layer].attention.output.LayerNorm, "layernorm")
    if family == "gpt2":
        return BlockNorms("pre", model.base_model.h[layer].ln_1, "layernorm")
    if family == "llama":
        return BlockNorms("pre", model.base_model.layers[layer].input_layernorm, "rmsnorm")
    if family == "headlab":
        return BlockNorms("pre", model.blocks[layer].ln1, "layernorm")
    raise UnsupportedArchitectureError(
        f"the residual-aware norms do not know the block structure of family {family!r}; "
        f"supported: {', '.join(SUPPORTED_FAMILIES)} (use mode='attention' for the attention-only norms)")


def is_causal(adapter) -> bool:
    """Whether the model's self-attention is causal (``adapter.causal`` when the adapter has it)."""
    c = getattr(adapter, "causal", None)
    if isinstance(c, bool):
        return c
    family = getattr(adapter, "family", "?")
    if family == "headlab":
        return bool(adapter.model.config.causal)
    return family in ("gpt2", "llama")


def norm_eps(norm: nn.Module) -> float:
    for name in ("eps", "variance_epsilon"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    return 1e-5


__all__ = ["SUPPORTED_FAMILIES", "BlockNorms", "is_causal", "layer_norms", "norm_eps"]
