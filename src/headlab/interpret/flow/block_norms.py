"""The norm layout around each attention layer, as the model's adapter describes it
(:meth:`~headlab.models.base.ModelAdapter.attention_norm`, a :class:`~headlab.models.norm_layout.BlockNorms`),
and whether the model is causal: what the residual-mode norms read. No family is named here; each
family's adapter declares its layout (pre, post, sandwich, parallel; LayerNorm or RMSNorm).
"""

from __future__ import annotations

from headlab.errors import UnsupportedArchitectureError
from headlab.models.norm_layout import BlockNorms


def layer_norms(adapter, layer: int) -> BlockNorms:
    """The norms around block ``layer``'s attention.

    Raises :class:`~headlab.errors.UnsupportedArchitectureError` for an adapter that does not say.
    """
    try:
        return adapter.attention_norm(layer)
    except UnsupportedArchitectureError as e:
        if getattr(adapter, "by_structure", False):  # structure found no layout: its reason says why
            raise
        raise UnsupportedArchitectureError(
            f"the residual-aware norms do not know the block structure of family {adapter.family!r} (its adapter "
            "has no attention_norm); use mode='attention' for the attention-only norms"
        ) from e


def is_causal(adapter) -> bool:
    """Whether the model's self-attention is causal."""
    return adapter.causal


__all__ = ["BlockNorms", "is_causal", "layer_norms"]
