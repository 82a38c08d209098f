"""Passkey prompts: keys hidden in filler text, asked for at the end (the test of KV policies and the data of gates).

Two uses, one owner:

- **The test** (Mohtashami and Jaggi 2023's passkey retrieval; multi-key as in RULER, Hsieh et al. 2024): one
  or several keys of five digits hidden at given depths of ``tokens`` tokens of filler, then a question whose
  greedy answer must contain the key. :func:`prompt` builds it, :func:`answered` scores an answer.
- **The training data** of a learned head split (DuoAttention, Xiao et al. 2024, trains its gates on
  synthetic contexts with passkeys, comparing hidden states where the keys are recited at the end):
  :func:`recital` builds one context and the positions to compare.

Two fillers ship with headlab: ``"repeated"``, the classic test's five sentences repeated ("The grass is
green. The sky is blue. ..."), and ``"haystack"``, fifty plain sentences about a village (shuffled by the
seed), which the training data uses so that a split is not fitted to the text it is then tested on.

    >>> from transformers import AutoTokenizer  # doctest: +SKIP
    >>> p = prompt(tok, tokens=1024, depths=[0.5], keys=["40718"])  # doctest: +SKIP
    >>> p.ids.shape, p.answer  # doctest: +SKIP
    (torch.Size([1, 1024]), '40718')
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from importlib import resources

import torch

import headlab.checks as checks
from headlab.errors import ConfigError, InputError

__all__ = ["REPEATED", "LABELS", "Prompt", "Recital", "answered", "draw_keys", "filler", "prompt", "recital"]

REPEATED = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
# what a multi-key needle is the key *of* (RULER's "special magic number for X")
LABELS = (
    "red door",
    "blue box",
    "green gate",
    "old clock",
    "north tower",
    "small boat",
    "stone bridge",
    "iron key",
    "white horse",
    "silver coin",
    "yellow kite",
    "glass jar",
)


def filler(kind: str = "repeated", seed: int = 0) -> list[str]:
    """The filler's sentences: ``"repeated"`` (5 sentences, in order) or ``"haystack"`` (50, shuffled by ``seed``)."""
    if kind == "repeated":
        return [s.strip() + "." for s in REPEATED.split(".") if s.strip()]
    if kind == "haystack":
        text = resources.files("headlab.decode").joinpath("assets", "haystack.txt").read_text(encoding="utf-8")
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        random.Random(seed).shuffle(lines)
        return lines
    raise ConfigError(f"filler {kind!r}: use 'repeated' (the classic passkey filler) or 'haystack'")


def draw_keys(n: int, rng: random.Random) -> list[str]:
    """``n`` distinct five-digit keys."""
    keys: list[str] = []
    while len(keys) < n:
        k = str(rng.randint(10000, 99999))
        if k not in keys:
            keys.append(k)
    return keys


@dataclass
class Prompt:
    """A passkey test: ``ids (1, n)``, the key asked for, where each needle sits (token index) and how deep, and
    how many of the last tokens are the question (``ids[:, -question:]``, asked after a compression)."""

    ids: torch.Tensor
    answer: str
    keys: list[str]
    labels: list[str] | None
    needle_at: list[int]
    depths: list[float]
    question: int = 0


@dataclass
class Recital:
    """A training context: ``ids (1, n)`` and ``positions``, the rows whose hidden state predicts a recited key token."""

    ids: torch.Tensor
    positions: torch.Tensor
    keys: list[str]


def _encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _fill(tok, sentences: list[str], n: int, start: int = 0) -> list[int]:
    """At least ``n`` tokens of the sentences, cycled from ``start``, cut to ``n``."""
    out: list[int] = []
    i = start
    while len(out) < n:
        out += _encode(tok, " " + sentences[i % len(sentences)])
        i += 1
    return out[:n]


def _check(tokens, depths, keys, labels):
    checks.int_at_least("tokens", tokens, 64, what=" (the prompt's length in tokens)")
    if not keys or len(depths) != len(keys):
        raise ConfigError(f"give one depth per key: {len(depths)} depths for {len(keys)} keys")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ConfigError(f"depths {list(depths)} must lie in [0, 1] (a share of the filler)")
    if labels is not None and len(labels) != len(keys):
        raise ConfigError(f"give one label per key: {len(labels)} labels for {len(keys)} keys")


def prompt(
    tok, tokens: int, depths, keys, *, labels=None, ask: int = 0, kind: str = "repeated", seed: int = 0
) -> Prompt:
    """The passkey test: ``keys`` at ``depths`` (shares of the filler) in a prompt of exactly ``tokens`` tokens.

    One key without ``labels`` is the classic test ("The pass key is K. Remember it. K is the pass key.", then
    "What is the pass key? The pass key is"); with ``labels``, each needle names what it is the key of and the
    question asks for the key of ``labels[ask]`` (the others are distractors).
    """
    _check(tokens, depths, keys, labels)
    if not 0 <= ask < len(keys):
        raise ConfigError(f"ask={ask}: the index of the key asked for, 0..{len(keys) - 1}")
    if labels is None:
        if len(keys) != 1:
            raise ConfigError("several keys need labels (which key is asked for)")
        needles = [f" The pass key is {keys[0]}. Remember it. {keys[0]} is the pass key."]
        question = "\nWhat is the pass key? The pass key is"
    else:
        needles = [f" The pass key for the {lab} is {k}. Remember it." for k, lab in zip(keys, labels)]
        question = f"\nWhat is the pass key for the {labels[ask]}? The pass key for the {labels[ask]} is"
    head = (
        [tok.bos_token_id]
        if getattr(tok, "bos_token_id", None) is not None and getattr(tok, "add_bos_token", False)
        else []
    ) + _encode(tok, INTRO)
    pieces = [_encode(tok, n) for n in needles]
    tail = _encode(tok, question)
    room = tokens - len(head) - len(tail) - sum(map(len, pieces))
    if room < 1:
        raise InputError(f"{tokens} tokens leave no room for filler around {len(keys)} needle(s); give more tokens")
    body = _fill(tok, filler(kind, seed), room)
    order = sorted(range(len(keys)), key=lambda i: depths[i])
    ids, at, last = list(head), [0] * len(keys), 0
    for i in order:
        cut = round(depths[i] * room)
        ids += body[last:cut]
        last = cut
        at[i] = len(ids)
        ids += pieces[i]
    ids += body[last:] + tail
    return Prompt(
        torch.tensor([ids]),
        keys[ask],
        list(keys),
        None if labels is None else list(labels),
        at,
        [float(d) for d in depths],
        len(tail),
    )


def answered(text: str | None, key: str) -> bool:
    """Exact match: the first five-digit number in the answer is the key."""
    got = re.findall(r"\d{5}", text or "")
    return bool(got) and got[0] == key


def recital(tok, tokens: int, n_keys: int, rng: random.Random, *, kind: str = "haystack", far: int = 0) -> Recital:
    """DuoAttention's kind of training context: ``n_keys`` labelled keys at random depths of ``tokens`` tokens
    of filler, then all of them recited; ``positions`` are the rows whose next token is a digit of a recited key.

    ``far``: every needle ends at least ``far`` tokens before the end of the filler (so that a window of that
    many recent tokens has evicted it by the recital, and every context teaches the gates something).
    """
    if not 1 <= n_keys <= len(LABELS):
        raise ConfigError(f"n_keys={n_keys}: between 1 and {len(LABELS)}")
    labels = rng.sample(LABELS, n_keys)
    keys = draw_keys(n_keys, rng)
    needles = [_encode(tok, f" The pass key for the {lab} is {k}. Remember it.") for k, lab in zip(keys, labels)]
    recite = [
        (_encode(tok, f" The pass key for the {lab} is"), _encode(tok, f" {k}"), _encode(tok, "."))
        for k, lab in zip(keys, labels)
    ]
    head = _encode(tok, INTRO)
    tail_len = len(_encode(tok, "\nRecite the pass keys.")) + sum(len(a) + len(b) + len(c) for a, b, c in recite)
    room = tokens - len(head) - tail_len - sum(map(len, needles))
    if room < n_keys:
        raise InputError(f"{tokens} tokens leave no room for filler around {n_keys} keys; give more tokens")
    sentences = filler(kind, rng.randrange(1 << 30))
    body = _fill(tok, sentences, room, start=rng.randrange(len(sentences)))
    if far >= room:
        raise InputError(f"{tokens} tokens leave {room} of filler, not more than far={far}; give more tokens")
    cuts = sorted(rng.randrange(room - far) for _ in range(n_keys))
    ids, last = list(head), 0
    for cut, nd in zip(cuts, needles):
        ids += body[last:cut] + nd
        last = cut
    ids += body[last:] + _encode(tok, "\nRecite the pass keys.")
    positions: list[int] = []
    for a, b, c in recite:
        ids += a
        positions += range(len(ids) - 1, len(ids) + len(b) - 1)  # the row before each key token predicts it
        ids += b + c
    return Recital(torch.tensor([ids]), torch.tensor(positions), keys)
