"""The registry of Hugging Face families: which ``config.model_type`` each adapts, and why others are refused.

A family registers itself with :func:`register` (its module is imported by :mod:`headlab.models.hf`).
Architectures headlab knows but cannot serve are listed in :data:`REFUSED` with the reason; any other
model type gets the refusal naming the nearest registered family and the page that says how to add one.
"""

from __future__ import annotations

import difflib

from torch import nn

from headlab.errors import ModelError, UnsupportedArchitectureError

FAMILIES: list[type] = []  # registered HFAdapter subclasses, in registration order

ADDING_A_FAMILY = "docs/adding-a-family.md"

# model types headlab knows and refuses, with the reason (checked before anything runs)
REFUSED: dict[str, str] = {
    "deberta-v2": "DeBERTa-v2's disentangled attention adds content-to-position and position-to-content terms "
                  "computed inside its own attention module (it does not call transformers' attention interface), "
                  "which headlab's backends do not compute",
}


def register(cls):
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


def adapter_class(model_type: str | None):
    return next((fam for fam in FAMILIES if model_type in fam.model_types), None)


def adapter_for(model: nn.Module):
    """The adapter of a Hugging Face model, by ``config.model_type``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    cls = adapter_class(model_type)
    if cls is None:
        raise UnsupportedArchitectureError(unsupported_message(model_type or type(model).__name__))
    return cls(model)


def nearest_family(what: str) -> str | None:
    """The registered model type whose name is closest to ``what`` (None when nothing is close)."""
    hits = difflib.get_close_matches(str(what).lower().replace("_", "-"), supported_model_types(), n=1, cutoff=0.5)
    return hits[0] if hits else None


def _families_text() -> str:
    return "; ".join(f"{fam.family} ({', '.join(fam.model_types)})" for fam in FAMILIES)


def unsupported_message(what: str) -> str:
    """One line: why ``what`` (a model type or class name) is refused, and what to do."""
    if what in REFUSED:
        return f"no headlab adapter for {what!r}: {REFUSED[what]}; supported families: {_families_text()}"
    near = nearest_family(what)
    hint = f"; the nearest registered family is {adapter_class(near).family!r} ({near})" if near else ""
    return (f"no headlab adapter for {what!r}{hint}; supported families: {_families_text()}; and headlab's own "
            f"Transformer; to add a family see {ADDING_A_FAMILY}")


def max_positions(config) -> int:
    """The longest input a Hugging Face config allows, in tokens (special tokens included)."""
    cls = adapter_class(getattr(config, "model_type", None))
    if cls is None:
        raise UnsupportedArchitectureError(unsupported_message(getattr(config, "model_type", "?")))
    return cls.max_positions(config)


__all__ = ["ADDING_A_FAMILY", "FAMILIES", "REFUSED", "adapter_class", "adapter_for", "max_positions",
           "nearest_family", "register", "supported_model_types", "unsupported_message"]
