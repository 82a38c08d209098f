"""What is being explained: the scalar y, the output distribution, and the word embeddings e_t.

Three kinds of model output, one interface (:class:`Objective`):

==============  ==============================================  ===============================
kind            y (the scalar explained)                        output distribution (LOO, ERASER)
==============  ==============================================  ===============================
classifier      the target class's logit (pre-softmax)          softmax over the classes
next_token      the logit of the target next token at the last  softmax over the vocabulary at
                position (a decoder; target = the predicted one) the last position
similarity      cosine similarity of the mean-pooled last        none: differences of y are used
                hidden state to a second text's (``compare_to``)
==============  ==============================================  ===============================

``e_t`` is the output of the word-embedding lookup (before position embeddings and normalisation).
:func:`embedding_override` replaces that output for one forward, so every method differentiates or
interpolates at exactly that point while the rest of the model (and the backend chosen with
``adapter.use_backend``) stays as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

import headlab.checks as checks
from headlab.errors import ConfigError, InputError, ModelError
from headlab.models.loader import LoadedModel


def embedding_module(model: nn.Module) -> nn.Embedding:
    """The word-embedding lookup of a supported model (Hugging Face or headlab's Transformer)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else getattr(model, "tok_emb", None)
    if not isinstance(emb, nn.Embedding):
        raise ModelError(
            f"cannot find the word-embedding lookup of {type(model).__name__} "
            "(get_input_embeddings() or tok_emb); saliency needs one"
        )
    return emb


@contextlib.contextmanager
def embedding_override(model: nn.Module, embeds: torch.Tensor) -> Iterator[None]:
    """Inside the block the word-embedding lookup returns ``embeds (B, L, E)`` instead of its output."""

    def hook(module, args, output):
        if output.shape != embeds.shape:
            raise ConfigError(
                f"embedding override of shape {tuple(embeds.shape)} for a lookup of shape {tuple(output.shape)}"
            )
        return embeds.to(output.dtype)

    handle = embedding_module(model).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def is_causal(loaded: LoadedModel) -> bool:
    return loaded.adapter.causal


@dataclass
class Objective:
    """How to run the model on ids (or overridden embeddings) and read y and the distribution.

    Attributes:
        loaded: the model.
        kind: ``"classifier"``, ``"next_token"`` or ``"similarity"`` (see the module docstring).
        target: the class (classifier) or token id (next_token); None for similarity.
        causal: the model is a decoder (its classification position is the last real token).
        reference: the second text's pooled embedding ``(E,)`` (similarity only).
    """

    loaded: LoadedModel
    kind: str
    target: int | None
    causal: bool
    reference: torch.Tensor | None = None

    @property
    def model(self) -> nn.Module:
        return self.loaded.model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, embeds: torch.Tensor | None = None):
        """Model outputs on ``input_ids (B, L)``; with ``embeds (B, L, E)`` they replace the word embeddings."""
        kw: dict[str, torch.Tensor | int] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.kind == "next_token" and self._keeps_logits() and bool(attention_mask.all()):
            kw["logits_to_keep"] = 1  # only the last position's logits: (B, 1, V), not (B, L, V)
        if embeds is None:
            return self.loaded.adapter.forward(kw)
        with embedding_override(self.model, embeds):
            return self.loaded.adapter.forward(kw)

    def _keeps_logits(self) -> bool:
        import inspect

        try:
            return "logits_to_keep" in inspect.signature(self.model.forward).parameters
        except (TypeError, ValueError):
            return False

    def logits(self, outputs, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(B, C)``: the class logits, or the next-token logits at each row's last real token."""
        if self.kind == "classifier":
            return outputs.logits
        if outputs.logits.shape[1] == 1:  # computed with logits_to_keep=1 (no padding)
            return outputs.logits[:, -1]
        last = attention_mask.long().sum(-1) - 1  # (B,) right padding
        return outputs.logits[torch.arange(len(last), device=last.device), last]  # (B, V)

    def value(self, outputs, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(B,)``: y for each row."""
        if self.kind == "similarity":
            assert self.reference is not None  # a similarity objective is built with its reference
            pooled = mean_pool(outputs.last_hidden_state, attention_mask)  # (B, E)
            return torch.nn.functional.cosine_similarity(pooled, self.reference.to(pooled.dtype)[None], dim=-1)
        return self.logits(outputs, attention_mask)[:, self.target]

    def probs(self, outputs, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """``(B, C)`` output distribution, or None for similarity."""
        if self.kind == "similarity":
            return None
        logits = self.logits(outputs, attention_mask)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return torch.softmax(logits, dim=-1)

    def y(self, input_ids, attention_mask, embeds=None) -> torch.Tensor:
        return self.value(self.forward(input_ids, attention_mask, embeds), attention_mask)

    def y_and_probs(self, input_ids, attention_mask, embeds=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.forward(input_ids, attention_mask, embeds)
        return self.value(out, attention_mask), self.probs(out, attention_mask)

    def position(self, attention_mask: torch.Tensor) -> int:
        """The classification position of a single input: 0 ([CLS]) or the last real token (decoders)."""
        return int(attention_mask[0].sum()) - 1 if self.causal else 0


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``(B, L, E) -> (B, E)``: mean over real tokens (sentence-transformers' pooling for MiniLM)."""
    m = attention_mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


def has_head(outputs) -> bool:
    return getattr(outputs, "logits", None) is not None


def make_objective(
    loaded: LoadedModel, enc: dict, target: int | None, compare_to: str | None
) -> tuple[Objective, dict]:
    """Choose the objective for ``loaded`` and resolve the target. Returns ``(objective, info)``.

    Raises :class:`~headlab.errors.ModelError` for a model with no head and no ``compare_to``, and
    :class:`~headlab.errors.InputError` for a target out of range.
    """
    causal = is_causal(loaded)
    with torch.no_grad():
        outputs = loaded.adapter.forward(enc)
    if compare_to is not None:
        if getattr(outputs, "last_hidden_state", None) is None:
            raise ModelError(
                f"{loaded.name}: compare_to needs a model that returns last_hidden_state "
                f"(a bare encoder such as headlab.load('minilm')); {type(loaded.model).__name__} does not"
            )
        if target is not None:
            raise InputError("target and compare_to exclude each other: a similarity has no classes")
        ref_enc = loaded.encode(compare_to)
        with torch.no_grad():
            ref = mean_pool(loaded.adapter.forward(ref_enc).last_hidden_state, ref_enc["attention_mask"])[0]
        return Objective(loaded, "similarity", None, causal, ref), {"labels": None}
    if not has_head(outputs):
        raise ModelError(
            f"{loaded.name} ({type(loaded.model).__name__}) has no classification or language-model head, so there "
            "is no prediction to explain; load a classifier (e.g. the SST-2 MiniLM `headlab train-classifier` "
            "makes) or a decoder (--model smollm2), or explain the cosine similarity of its pooled "
            "embedding to a second text with compare_to='...' (CLI: --compare-to TEXT)"
        )
    logits = outputs.logits
    if logits.dim() == 2:
        kind, n = "classifier", logits.shape[-1]
        cfg = getattr(loaded.model, "config", None)
        labels = getattr(cfg, "id2label", None)
        labels = [str(labels.get(i, i)) for i in range(n)] if isinstance(labels, dict) else None
        row = logits[0]
    elif causal:
        kind, n, labels = "next_token", logits.shape[-1], None
        row = logits[0, int(enc["attention_mask"][0].sum()) - 1]
    else:
        raise ModelError(
            f"{loaded.name} is an encoder with a per-token head ({type(loaded.model).__name__}); "
            "saliency explains a classifier's class logit or a decoder's next token: load a "
            "sequence classifier, or use compare_to='...' with the bare encoder"
        )
    if target is None:
        target = int(row.argmax())
    elif not 0 <= checks.integer("target", target, what=" class (or token id)", error=InputError) < n:
        what = "classes" if kind == "classifier" else "tokens in the vocabulary"
        raise InputError(f"target {target} is out of range: the model has {n} {what} (0..{n - 1})")
    return Objective(loaded, kind, int(target), causal), {"labels": labels}


def special_mask(loaded: LoadedModel, input_ids: torch.Tensor) -> list[bool]:
    """Which positions of one input hold special tokens ([CLS], [SEP], BOS, EOS...)."""
    tok = loaded.tokenizer
    ids = input_ids[0].tolist()
    if tok is None:
        return [False] * len(ids)
    special = set(getattr(tok, "all_special_ids", []) or [])
    return [i in special for i in ids]


def baseline_id(loaded: LoadedModel) -> int | None:
    """The token whose embedding replaces every non-special token in the default IG baseline: pad, else unk."""
    tok = loaded.tokenizer
    for attr in ("pad_token_id", "unk_token_id"):
        v = getattr(tok, attr, None) if tok is not None else None
        if v is not None:
            return int(v)
    cfg = getattr(loaded.model, "config", None)
    v = getattr(cfg, "pad_token_id", None)
    return None if v is None else int(v)
