"""Prompt pairs in text: tokenise clean and corrupted prompts and build the logit-difference metric.

:func:`prompt_pair` is what ``headlab patch`` and the IOI study call: the prompts are encoded with the
model's tokenizer (right-padded as one batch), each pair is checked to tokenise to the same length,
and ``answer`` / ``wrong`` must each be one token (with its leading space, as the model would write it
after the prompt: ``" Mary"``). The metric reads each prompt's last real token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from headlab.errors import InputError, ModelError
from headlab.interpret.patching.metrics import Metric, logit_diff


def single_token(tokenizer, word: str, what: str) -> int:
    """The id of ``word`` as one token (no special tokens added); InputError when it is several or none."""
    if not isinstance(word, str) or not word.strip():
        raise InputError(f"{what} is empty; give a word such as ' Mary' (with its leading space)")
    ids = tokenizer(word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise InputError(
            f"{what} {word!r} is {len(ids)} tokens ({pieces}); the logit difference compares single "
            "tokens: choose a word the tokenizer keeps whole (often with a leading space)"
        )
    return int(ids[0])


def prompt_pair(
    loaded,
    clean: str | Sequence[str],
    corrupted: str | Sequence[str],
    answer: str | Sequence[str],
    wrong: str | Sequence[str],
) -> tuple[dict, dict, Metric]:
    """``(clean inputs, corrupted inputs, logit_diff metric)`` for text prompts.

    Args:
        loaded: a :class:`~headlab.models.loader.LoadedModel` with a tokenizer.
        clean, corrupted: a prompt or a list of prompts (pairwise the same length in tokens).
        answer, wrong: one word for all prompts, or one per prompt; each must be a single token.
    """
    tok = getattr(loaded, "tokenizer", None)
    if tok is None:
        raise ModelError(
            "text prompts need a model with a tokenizer (headlab.load(...)); pass token ids to "
            "headlab.patch for a bare model"
        )
    cl = [clean] if isinstance(clean, str) else list(clean)
    co = [corrupted] if isinstance(corrupted, str) else list(corrupted)
    if len(cl) != len(co) or not cl:
        raise InputError(f"{len(cl)} clean and {len(co)} corrupted prompts: give them in pairs")

    def per_prompt(x, what):
        xs = [x] * len(cl) if isinstance(x, str) else list(x)
        if len(xs) != len(cl):
            raise InputError(f"{len(xs)} {what} words for {len(cl)} prompts; give one, or one per prompt")
        return [single_token(tok, w, what) for w in xs]

    right, bad = per_prompt(answer, "--answer"), per_prompt(wrong, "--wrong")
    same = [i for i, (r, w) in enumerate(zip(right, bad)) if r == w]
    if same:
        i = same[0]
        raise InputError(
            f"--answer and --wrong are the same token ({tok.convert_ids_to_tokens([right[i]])[0]!r}, id "
            f"{right[i]}) for prompt {i}: their logit difference is 0 on every run, so every effect "
            "would be 0/0; give the right and a wrong next token"
        )
    a, b = loaded.encode(cl), loaded.encode(co)
    if a["input_ids"].shape != b["input_ids"].shape or not torch.equal(a["attention_mask"], b["attention_mask"]):
        la, lb = a["attention_mask"].sum(-1).tolist(), b["attention_mask"].sum(-1).tolist()
        raise InputError(
            f"clean prompts are {la} tokens long and corrupted {lb}: patching pairs position i with "
            "position i, so each corrupted prompt must have as many tokens as its clean twin"
        )
    twins = [i for i in range(len(cl)) if torch.equal(a["input_ids"][i], b["input_ids"][i])]
    if twins:
        raise InputError(
            f"clean and corrupted prompt {twins[0]} tokenise to the same tokens: patching one into the "
            "other changes nothing (every effect would be 0/0); corrupt the prompt (other names)"
        )
    last = a["attention_mask"].sum(-1) - 1  # (B,) the last real token of each right-padded prompt
    return a, b, logit_diff(right, bad, position=last)


__all__ = ["prompt_pair", "single_token"]
