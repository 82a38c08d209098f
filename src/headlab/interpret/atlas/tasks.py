"""The atlas's inputs: repeated random tokens, natural text and needle-in-a-haystack prompts, as token ids.

Every builder returns token ids with the spans the scores and the checks need, so that no score ever
searches a string. A model with a tokenizer gets its own special tokens around each sequence
(Llama's BOS, BERT's [CLS] ... [SEP]); headlab's own models (no tokenizer) take ids as given.

- :func:`repeated` (Olsson et al. 2022): ``prefix + x_1..x_T + x_1..x_T + suffix`` with ``x`` uniform
  over the vocabulary minus its special tokens; ``start = len(prefix)``.
- :func:`natural`: the user's texts, or the public-domain passage shipped in ``assets/haystack.txt``
  (the opening chapters of Jane Austen's *Pride and Prejudice*, 1813), cut into pieces of at most
  ``max_tokens`` tokens.
- :func:`needles` (Wu et al. 2024): a haystack of natural text with one needle sentence inserted at a
  chosen depth, then a query that repeats the needle's opening words; the model is to continue with
  the rest of the needle (its *answer*), which appears nowhere else.

    >>> import torch
    >>> from headlab.interpret.atlas.tasks import repeated
    >>> ids, start = repeated(None, vocab=50, n=2, half=3, seed=0)
    >>> ids.shape, start, bool((ids[:, :3] == ids[:, 3:]).all())
    (torch.Size([2, 6]), 0, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import torch

from headlab.errors import ConfigError, InputError

# needles: (the words the query repeats, the answer the model must copy)
_NEEDLES = [
    ("The secret password for the old library is", " violet harbour seventeen"),
    ("The name of the captain's lost dog was", " Biscuit Montgomery"),
    ("The treasure is buried under the", " crooked lemon tree"),
    ("The code to open the garden gate is", " four nine two six"),
    ("The best thing to do in San Francisco is", " eat a sandwich in Dolores Park"),
    ("My favourite colour of the rainbow is", " deep cobalt blue"),
    ("The baker's secret ingredient is", " smoked paprika"),
    ("The train to the coast leaves at", " seven forty"),
]


def haystack_text() -> str:
    """The shipped public-domain passage (``assets/haystack.txt``)."""
    return resources.files("headlab.interpret.atlas").joinpath("assets", "haystack.txt").read_text(encoding="utf-8")


def _specials(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a sequence (``([CLS], [SEP])``, ``([BOS], [])``...):
    what encoding a word adds around the same word encoded without special tokens."""
    if tokenizer is None:
        return [], []
    bare = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a")["input_ids"])
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return full[:i], full[i + len(bare) :]
    return [], []


def _encode(tokenizer, text: str) -> list[int]:
    """Token ids without specials, a paragraph at a time (a long text in one call draws the tokenizer's
    warning about its maximum length, which concerns the model, not the tokenizer)."""
    parts = text.split("\n\n")
    ids: list[int] = []
    for i, p in enumerate(parts):
        ids += tokenizer(p + ("\n\n" if i < len(parts) - 1 else ""), add_special_tokens=False)["input_ids"]
    return ids


def repeated(tokenizer, *, vocab: int, n: int, half: int, seed: int) -> tuple[torch.Tensor, int]:
    """``(ids (n, P + 2 half + S), start = P)``: random tokens repeated once, in the model's specials."""
    if not isinstance(half, int) or half < 2:
        raise ConfigError(f"the repeated half must hold at least 2 tokens, got {half!r}")
    pre, post = _specials(tokenizer)
    banned = set(getattr(tokenizer, "all_special_ids", []) or []) | set(pre) | set(post)
    allowed = torch.tensor([t for t in range(vocab) if t not in banned])
    g = torch.Generator().manual_seed(seed)
    x = allowed[torch.randint(0, len(allowed), (n, half), generator=g)]
    body = torch.cat([x, x], 1)
    ids = torch.cat(
        [torch.tensor(pre, dtype=torch.long).expand(n, -1), body, torch.tensor(post, dtype=torch.long).expand(n, -1)], 1
    )
    return ids, len(pre)


def natural(tokenizer, texts, *, max_tokens: int, n: int) -> list[torch.Tensor]:
    """Up to ``n`` id sequences of natural text (specials included), each of at most ``max_tokens`` tokens.

    ``texts``: strings (cut into consecutive pieces), token-id sequences (for models without a tokenizer),
    or None for the shipped passage."""
    if texts is None:
        if tokenizer is None:
            raise InputError(
                "a model without a tokenizer needs texts= as token-id sequences for its natural-text "
                "tasks (sink, local, retrieval)"
            )
        texts = [haystack_text()]
    pre, post = _specials(tokenizer)
    room = max_tokens - len(pre) - len(post)
    if room < 4:
        raise ConfigError(f"max_tokens={max_tokens} leaves no room for text beside the special tokens")
    out: list[torch.Tensor] = []
    for t in texts:
        if isinstance(t, str):
            if tokenizer is None:
                raise InputError("text given for a model without a tokenizer; pass token-id sequences")
            ids = _encode(tokenizer, t)
        else:
            ids = [int(x) for x in torch.as_tensor(t).reshape(-1).tolist()]
        for s in range(0, len(ids), room):
            piece = ids[s : s + room]
            if len(piece) >= min(room, 8):
                out.append(torch.tensor(pre + piece + post, dtype=torch.long))
    if not out:
        raise InputError("the texts hold no piece of at least 8 tokens; give longer texts")
    return out[:n]


@dataclass(frozen=True)
class Needle:
    """One needle-in-a-haystack prompt: ``ids`` ``(L,)`` = haystack with the needle at ``needle``
    (a ``(start, stop)`` span), then the query; ``answer`` ``(n,)`` the ids the model should continue with."""

    ids: torch.Tensor
    needle: tuple[int, int]
    answer: torch.Tensor
    depth: float


def needles(tokenizer, *, texts, n: int, haystack_tokens: int, seed: int, vocab: int | None = None) -> list[Needle]:
    """``n`` prompts, needles placed at depths evenly spread over (0.1, 0.9) of a haystack of about
    ``haystack_tokens`` tokens. Without a tokenizer the needle is random ids (a key of 4 and an answer
    of 4) and the haystack comes from ``texts`` (token ids)."""
    if n < 1:
        raise ConfigError(f"needle trials must be at least 1, got {n!r}")
    g = torch.Generator().manual_seed(seed)
    pre, _ = _specials(tokenizer)
    hay_src = natural(tokenizer, texts, max_tokens=10**9, n=10**6)
    hay = torch.cat([h[len(pre) :] for h in hay_src])  # one long stream (specials of each piece dropped)
    if len(hay) < haystack_tokens:
        hay = hay.repeat(haystack_tokens // max(len(hay), 1) + 1)
    out = []
    for i in range(n):
        depth = 0.1 + 0.8 * (i + 0.5) / n
        off = int(torch.randint(0, max(1, len(hay) - haystack_tokens), (1,), generator=g))
        chunk = hay[off : off + haystack_tokens].tolist()
        if tokenizer is not None:
            key_text, ans_text = _NEEDLES[i % len(_NEEDLES)]
            key, ans = _encode(tokenizer, " " + key_text), _encode(tokenizer, ans_text)
            dot = _encode(tokenizer, ".")
            query = _encode(tokenizer, "\n\n" + key_text)
        else:
            if vocab is None:
                raise ConfigError("needles without a tokenizer need vocab=")
            r = torch.randint(0, vocab, (8,), generator=g).tolist()
            key, ans, dot, query = r[:4], r[4:], [], r[:4]
        cut = int(depth * len(chunk))
        before = pre + chunk[:cut]
        needle = key + ans + dot
        ids = before + needle + chunk[cut:] + query
        out.append(
            Needle(
                torch.tensor(ids, dtype=torch.long),
                (len(before), len(before) + len(needle)),
                torch.tensor(ans, dtype=torch.long),
                depth,
            )
        )
    return out


__all__ = ["Needle", "haystack_text", "natural", "needles", "repeated"]
