"""What a decoding model has: query and kv heads per layer, and whether it decodes at all."""

from __future__ import annotations

from headlab.errors import ModelError

__all__ = ["check_decoder", "kv_layout"]


def kv_layout(model) -> tuple[list[int], list[int]]:
    """``(query heads per layer, kv heads per layer)`` of a model, LoadedModel or adapter, or of a
    ``(heads, kv_heads)`` pair of lists given directly."""
    if isinstance(model, tuple) and len(model) == 2:
        return list(model[0]), list(model[1])
    from headlab.models.loaded_model import resolve

    adapter, _ = resolve(model)
    return list(adapter.layer_heads), list(adapter.layer_kv_heads)


def check_decoder(adapter, name: str = "the model") -> None:
    """Refuse a model that cannot decode (an encoder-only model has no causal attention nor LM head)."""
    if not adapter.causal:
        raise ModelError(
            f"{name} is an encoder-only model (bidirectional attention, no next-token head): a KV cache "
            "and decoding need a causal language model such as smollm2"
        )
