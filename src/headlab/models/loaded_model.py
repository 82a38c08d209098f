"""A model ready for headlab: :class:`LoadedModel`; :func:`adapt` for a model you built; :func:`resolve`.

Kept apart from :mod:`headlab.models.loader` (which finds and reads model folders) so that modules the
loader itself uses, such as the pruned-model reader, can name these without a circle.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from headlab.errors import ConfigError, InputError, ModelError, UnsupportedArchitectureError
from headlab.models.base import ModelAdapter


class TruncationWarning(UserWarning):
    """Text was cut to the model's maximum positions (``encode(..., truncate=True)``)."""


@dataclass
class LoadedModel:
    """A model ready for headlab: the module, its tokenizer, its adapter.

    Attributes:
        model: the ``nn.Module`` (in eval mode).
        tokenizer: a Hugging Face tokenizer, or None (headlab's own models take token ids).
        adapter: the :class:`~headlab.models.base.ModelAdapter`.
        name: the name or path it was loaded from.
        family: ``"bert"``, ``"gpt2"``, ``"llama"`` or ``"headlab"``.
        max_positions: the longest input, in tokens (special tokens included).
    """

    model: Any  # an nn.Module: a transformers model or headlab's Transformer (its config read by name)
    tokenizer: Any  # a Hugging Face tokenizer, or None
    adapter: ModelAdapter
    name: str
    family: str
    max_positions: int

    def encode(
        self, text_or_texts: str | list[str], *, max_length: int | None = None, truncate: bool = False
    ) -> dict[str, torch.Tensor]:
        """Tokenise into ``{"input_ids": (B, L), "attention_mask": (B, L)}`` (padded on the right).

        Args:
            text_or_texts: one text or a list of texts; none may be empty.
            max_length: the most tokens to accept (default and ceiling: :attr:`max_positions`).
            truncate: when a text is longer, keep its first ``max_length`` tokens and warn instead of
                raising :class:`~headlab.errors.InputError`.
        """
        if self.tokenizer is None:
            raise ModelError(
                f"{self.name} has no tokenizer; pass token ids to the model yourself "
                "(headlab.capture accepts an input_ids tensor)"
            )
        if not isinstance(text_or_texts, str | list | tuple):
            raise InputError(
                f"encode takes a text or a list of texts, got {type(text_or_texts).__name__}; "
                "pass a string such as \"the cat sat\""
            )
        texts = [text_or_texts] if isinstance(text_or_texts, str) else list(text_or_texts)
        if not texts:
            raise InputError("no text given: pass a non-empty string")
        for t in texts:
            if not isinstance(t, str):
                raise InputError(f"texts must be strings, got {type(t).__name__}")
            if not t.strip():
                raise InputError("the text is empty (or only whitespace): give at least one word")
        limit = self.max_positions if max_length is None else int(max_length)
        if limit <= 0 or limit > self.max_positions:
            raise InputError(
                f"max_length={max_length} is outside 1..{self.max_positions} (the positions {self.name} reads)"
            )
        enc = self.tokenizer(texts, padding=True, truncation=False, return_tensors="pt", verbose=False)
        n = int(enc["attention_mask"].sum(-1).max())
        if n > limit:
            if not truncate:
                raise InputError(
                    f"the text is {n} tokens long (special tokens included) but {self.name} reads at most {limit}; "
                    f"shorten it, or pass truncate=True (CLI: --truncate) to keep the first {limit} tokens"
                )
            warnings.warn(
                f"text truncated from {n} to {limit} tokens ({self.name} reads at most {limit}); "
                f"the last {n - limit} tokens are not analysed",
                TruncationWarning,
                stacklevel=2,
            )
            enc = self.tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt")
        device = next(self.model.parameters()).device
        return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}

    def tokens(self, text: str, **encode_kwargs) -> list[str]:
        """The token strings the model sees for ``text``, special tokens included (``[CLS]`` ... ``[SEP]``)."""
        ids = self.encode(text, **encode_kwargs)["input_ids"][0]
        return self.tokenizer.convert_ids_to_tokens(ids.tolist())

    def __call__(self, inputs):
        return self.adapter.forward(inputs)


def adapt(model: nn.Module, *, check: bool = True) -> ModelAdapter:
    """The :class:`ModelAdapter` of ``model`` (built once, then cached on the model).

    A Hugging Face model of a type no family declares is adapted by its structure and served only after the
    load-time check passes on its weights (:mod:`headlab.models.hf.verify`; ``check=False`` skips it, for
    inspection). Raises :class:`~headlab.errors.UnsupportedArchitectureError` naming what failed.

    A PEFT LoRA model (a ``PeftModel`` or a model with LoRA layers in it) is read through its base model's
    structure with the adapter's deltas in its weights (:mod:`headlab.models.hf.peft_lora`).
    """
    if "peft" in sys.modules and isinstance(model, nn.Module):  # PEFT objects exist only once peft is imported
        from headlab.models.hf.peft_lora import adapt_lora

        lora = adapt_lora(model, check=check)
        if lora is not None:
            return lora
    cached = getattr(model, "_headlab_adapter", None)
    if isinstance(cached, ModelAdapter):
        return cached
    if isinstance(model, ModelAdapter):
        return model
    from headlab.models.transformer import Transformer, TransformerAdapter

    if isinstance(model, Transformer):
        adapter = TransformerAdapter(model)
    elif hasattr(model, "config") and hasattr(model.config, "model_type"):
        from headlab.models.hf import adapter_for

        adapter = adapter_for(model, check=check)
    else:
        from headlab.models.hf import unsupported_message

        raise UnsupportedArchitectureError(unsupported_message(type(model).__name__))
    model._headlab_adapter = adapter  # type: ignore[assignment]  # torch types module attributes Tensor | Module
    return adapter


def resolve(target) -> tuple[ModelAdapter, LoadedModel | None]:
    """``(adapter, LoadedModel or None)`` from a :class:`LoadedModel`, a :class:`ModelAdapter` or a model
    (adapted on the way): what every analysis accepts as "the model"."""
    if isinstance(target, LoadedModel):
        return target.adapter, target
    if isinstance(target, ModelAdapter):
        return target, None
    if isinstance(target, nn.Module):
        return adapt(target), None
    raise ConfigError(f"expected a model, a LoadedModel (headlab.load) or a ModelAdapter, got {type(target).__name__}")
