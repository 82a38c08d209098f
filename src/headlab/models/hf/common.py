"""What the Hugging Face families share: the registry, switching the attention implementation, weight splits."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from headlab.errors import ModelError, UnsupportedArchitectureError
from headlab.models.base import ModelAdapter
from headlab.models.hf import attention_fn

FAMILIES: list[type[HFAdapter]] = []  # registered families, in registration order


def register(cls: type[HFAdapter]) -> type[HFAdapter]:
    """Class decorator: add a family to the registry (its ``model_types`` become loadable)."""
    taken = {t for fam in FAMILIES for t in fam.model_types}
    clash = taken.intersection(cls.model_types)
    if clash:
        raise ModelError(f"{cls.__name__} registers model types {sorted(clash)} that another family already has")
    FAMILIES.append(cls)
    return cls


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` a registered family adapts."""
    return [t for fam in FAMILIES for t in fam.model_types]


def adapter_class(model_type: str | None) -> type[HFAdapter] | None:
    return next((fam for fam in FAMILIES if model_type in fam.model_types), None)


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter of a Hugging Face model, by ``config.model_type``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    cls = adapter_class(model_type)
    if cls is None:
        raise UnsupportedArchitectureError(unsupported_message(model_type or type(model).__name__))
    return cls(model)


def unsupported_message(what: str) -> str:
    fams = "; ".join(f"{fam.description} ({', '.join(fam.model_types)})" for fam in FAMILIES)
    return f"no headlab adapter for {what!r}; supported families: {fams}; and headlab's own Transformer"


def max_positions(config) -> int:
    """The longest input a Hugging Face config allows, in tokens (special tokens included)."""
    cls = adapter_class(getattr(config, "model_type", None))
    if cls is None:
        raise UnsupportedArchitectureError(unsupported_message(getattr(config, "model_type", "?")))
    return cls.max_positions(config)


def split_linear_in(weight: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """``nn.Linear(E -> heads*d).weight (heads*d, E)`` as ``(heads, E, d)`` (a view)."""
    return weight.view(heads, d, weight.shape[1]).transpose(1, 2)


def split_linear_out(weight: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """``nn.Linear(heads*d -> E).weight (E, heads*d)`` as ``(heads, d, E)`` (a view)."""
    return weight.t().view(heads, d, weight.shape[0])


class HFAdapter(ModelAdapter):
    """A Hugging Face family. Subclasses set the class attributes and say where the modules are.

    ``nn.Linear`` stores ``weight (out, in)`` and computes ``x @ weight.T``; GPT-2's ``Conv1D`` stores
    ``weight (in, out)`` and computes ``x @ weight``. The per-head views are views: editing them
    edits the model.
    """

    model_types: ClassVar[tuple[str, ...]] = ()  # the config.model_type values this family adapts
    description: ClassVar[str] = ""  # how the unsupported-architecture message names the family

    @classmethod
    def max_positions(cls, config) -> int:
        n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if n is None:
            raise ModelError(f"cannot tell the maximum positions of a {config.model_type} config")
        return int(n)

    def _enter_backend(self):
        """Switch the model to headlab's attention implementation with transformers' public API."""
        saved = self.model.config._attn_implementation
        if saved != attention_fn.IMPLEMENTATION:
            self.model.set_attn_implementation(attention_fn.IMPLEMENTATION)
        return saved

    def _exit_backend(self, saved) -> None:
        if saved != self.model.config._attn_implementation:
            self.model.set_attn_implementation(saved)
