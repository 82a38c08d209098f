"""Adapters for Hugging Face transformers v5 families, one registered class per family.

A family is one class in this package (:class:`~headlab.models.hf.family.HFAdapter`, declared with the
layouts of :mod:`headlab.models.projections`) decorated with :func:`~headlab.models.hf.registry.register`.
The support table (``headlab models``, ``docs/models.md``), the message for an unsupported architecture
and the maximum positions are all read from the registered classes.

    >>> from headlab.models.hf import supported_model_types
    >>> "qwen3" in supported_model_types() and "gemma3_text" in supported_model_types()
    True
"""

from __future__ import annotations

from headlab.models.hf import (  # noqa: F401  (each registers its family)
    albert,
    bert,
    bloom,
    cohere,
    distilbert,
    eurobert,
    falcon,
    gemma,
    gpt2,
    gpt_neox,
    gptj,
    llama,
    modernbert,
    olmo2,
    opt,
    phi,
    phi3,
    seq2seq,
    stablelm,
    vit,
)

# isort: split
from headlab.models.hf import structure  # noqa: F401  (after the families: serves the types none declares)
from headlab.models.hf.family import HFAdapter
from headlab.models.hf.registry import (
    FAMILIES,
    REFUSED,
    adapter_class,
    adapter_for,
    max_positions,
    supported_model_types,
    unsupported_message,
)

__all__ = [
    "FAMILIES",
    "HFAdapter",
    "REFUSED",
    "adapter_class",
    "adapter_for",
    "max_positions",
    "supported_model_types",
    "unsupported_message",
]
