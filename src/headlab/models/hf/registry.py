"""The registry of Hugging Face families: which ``config.model_type`` each adapts, and why others are refused.

A family registers itself with :func:`register` (its module is imported by :mod:`headlab.models.hf`).
Architectures headlab knows but cannot serve are listed in :data:`REFUSED` with the reason. Any other model
type is adapted by its structure (:mod:`headlab.models.hf.structure`) and served once the load-time check
(:mod:`headlab.models.hf.verify`) passes on the loaded weights; when it fails, the refusal names the check and
the registered family nearest the structure found (:func:`nearest_by_structure`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from headlab.errors import ModelError, UnsupportedArchitectureError
from headlab.registry import Registry

if TYPE_CHECKING:
    from headlab.models.hf.family import HFAdapter


def _taken(cls, types: list[str]) -> ModelError:
    return ModelError(f"{cls.__name__} registers model types {sorted(types)} that another family already has")


# registered HFAdapter subclasses, each under its config.model_types, in registration order
_FAMILIES: Registry[type[HFAdapter]] = Registry(
    "a model family",
    "transformers' config.model_type picks it",
    instances=False,
    key=lambda cls: cls.model_types,
    taken=_taken,
)
FAMILIES: list[type[HFAdapter]] = _FAMILIES.items
# what serves the types no family declares: headlab.models.hf.structure registers its adapt_by_structure,
# max_positions and nearest_by_structure here when the package imports it (the registry imports no family)
BY_STRUCTURE: dict = {}

ADDING_A_FAMILY = "docs/adding-a-family.md"

# model types headlab knows and refuses, with the reason (checked before anything runs)
REFUSED: dict[str, str] = {
    "deepseek_v3": "DeepSeek-V3's multi-head latent attention computes keys and values from a shared low-rank latent "
    "(kv_a_proj, then kv_b_proj) and splits each query and key into a rotary and a non-rotary part "
    "of other widths than the value's, so its heads have no single W_Q, W_K, W_V of one head size",
}


def register(cls):
    """Class decorator: add a family to the registry (its ``model_types`` become loadable)."""
    return _FAMILIES.register(cls)


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` a registered family adapts."""
    return _FAMILIES.names()


def adapter_class(model_type: str | None):
    return _FAMILIES.find(model_type) if model_type is not None else None


def adapter_for(model: nn.Module, *, check: bool = True):
    """The adapter of a Hugging Face model: its declared family by ``config.model_type``, else the one its
    structure gives, verified on the loaded weights (``check=False`` skips the check: for inspection only)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in REFUSED:
        raise UnsupportedArchitectureError(unsupported_message(model_type))
    cls = adapter_class(model_type)
    if cls is None:
        return BY_STRUCTURE["adapt"](model, check=check)
    return cls(model)


def _families_text() -> str:
    return "; ".join(f"{fam.family} ({', '.join(fam.model_types)})" for fam in FAMILIES)


def unsupported_message(what: str) -> str:
    """One line: why ``what`` (a model type or class name) is refused, and what to do."""
    if what in REFUSED:
        return f"no headlab adapter for {what!r}: {REFUSED[what]}; supported families: {_families_text()}"
    return (
        f"no headlab adapter for {what!r}: it is not a Hugging Face transformers model (no config.model_type) "
        f"nor headlab's own Transformer; Hugging Face models of any type are adapted by structure (declared "
        f"families: {_families_text()}); to add a family see {ADDING_A_FAMILY}"
    )


def max_positions(config) -> int:
    """The longest input a Hugging Face config allows, in tokens (special tokens included): the declared
    family's rule, else the config's own position count (a type adapted by structure)."""
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED:
        raise UnsupportedArchitectureError(unsupported_message(model_type))
    cls = adapter_class(model_type)
    if cls is None:
        return BY_STRUCTURE["max_positions"](config)
    return cls.max_positions(config)


__all__ = [
    "ADDING_A_FAMILY",
    "FAMILIES",
    "REFUSED",
    "adapter_class",
    "adapter_for",
    "max_positions",
    "BY_STRUCTURE",
    "register",
    "supported_model_types",
    "unsupported_message",
]
