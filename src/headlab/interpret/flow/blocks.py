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

def _supported() -> list[str]:
    from headlab.models.hf import FAMILIES

    return [fam.family for fam in FAMILIES] + ["headlab"]


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
    """The norm module around block ``layer``'s attention, as the adapter describes it
    (:meth:`~headlab.models.base.ModelAdapter.attention_norm`).

    Raises :class:`~headlab.errors.UnsupportedArchitectureError` for a family whose adapter does not say,
    naming the supported ones.
    """
    try:
        layout, norm, kind = adapter.attention_norm(layer)
    except UnsupportedArchitectureError:
        raise UnsupportedArchitectureError(
            f"the residual-aware norms do not know the block structure of family {adapter.family!r}; "
            f"supported: {', '.join(_supported())} (use mode='attention' for the attention-only norms)") from None
    return BlockNorms(layout, norm, kind)


def is_causal(adapter) -> bool:
    """Whether the model's self-attention is causal."""
    return adapter.causal


def norm_eps(norm: nn.Module) -> float:
    for name in ("eps", "variance_epsilon"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    return 1e-5


__all__ = ["BlockNorms", "is_causal", "layer_norms", "norm_eps"]
