"""Tokens to words: alignment from a fast tokenizer's character offsets, and word-level attention.

Every tokenizer family reports, for each token, the characters of the text it covers: WordPiece
(``##`` continuations), byte-level BPE with a leading-space marker (GPT-2, Llama 3, SmolLM2: ``Ġcat``
covers `` cat``) and SentencePiece (``▁cat``). Spans are trimmed of white space, and a token belongs
to every word whose characters it overlaps, so the marker never matters; a token that is a marker
alone (``▁``, ``Ġ``) belongs to no word. Special tokens ([CLS],
[SEP], BOS, EOS: the tokenizer's ``special_tokens_mask``) belong to no word and are kept aside.

Word-level attention, as Clark et al. (2019, section 4.1) merge split words: attention *to* a word
is the sum over its tokens, attention *from* a word the mean over its tokens. With the alignment
matrices ``A_to (N, T)`` (1 where token t belongs to word w) and ``A_from = A_to / row sums``:

    word_att = A_from @ att @ A_to^T          # (..., N, N) from (..., T, T)

so a row of ``word_att`` sums to the attention the word's tokens give to words (1 minus what goes to
special tokens and to white-space-only tokens).

    >>> import torch
    >>> att = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]])   # (1, 3 tokens, 3)
    >>> a_to = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]])                   # word 1 = tokens 1, 2
    >>> word_attention(att[:, None], a_to).squeeze()
    tensor([[0.5000, 0.5000],
            [0.1500, 0.8500]])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from headlab.errors import ModelError
from headlab.interpret.probing.treebank import ROOT, Sentence


@dataclass(frozen=True)
class Aligned:
    """One sentence, tokenised and aligned.

    Attributes:
        sentence: the treebank sentence.
        ids: ``(T,)`` token ids, special tokens included.
        a_to: ``(N, T)`` bool, token t belongs to word w.
        special: ``(T,)`` bool, a special token ([CLS], [SEP], BOS, ...).
        sep: ``(T,)`` bool, a separator or end token ([SEP], EOS), not at position 0.
        punct: ``(T,)`` bool, the token belongs to a punctuation word (UPOS PUNCT).
    """

    sentence: Sentence
    ids: np.ndarray
    a_to: np.ndarray
    special: np.ndarray
    sep: np.ndarray
    punct: np.ndarray

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


def check_fast(tokenizer, name: str = "the model") -> None:
    """Raise :class:`~headlab.errors.ModelError` unless ``tokenizer`` is a fast (Rust) tokenizer."""
    if tokenizer is None:
        raise ModelError(f"{name} has no tokenizer; probing aligns tokens to words with a fast tokenizer's offsets")
    if not getattr(tokenizer, "is_fast", False):
        raise ModelError(
            f"{name}'s tokenizer ({type(tokenizer).__name__}) is not a fast tokenizer, and probing needs "
            "the character offsets of each token that only fast tokenizers report; save the model with "
            "a tokenizer.json (transformers: AutoTokenizer.from_pretrained(..., use_fast=True))"
        )


def token_word_matrix(
    text: str, offsets: Sequence[tuple[int, int]], special: Sequence[bool], spans: Sequence[tuple[int, int]]
) -> np.ndarray:
    """``(N, T)`` bool: token t (its characters trimmed of white space) overlaps word w's characters.

    >>> token_word_matrix("a cat", [(0, 0), (0, 1), (1, 3), (3, 5)], [True, False, False, False], [(0, 1), (2, 5)]).astype(int)
    array([[0, 1, 0, 0],
           [0, 0, 1, 1]])
    """
    T = len(offsets)
    tok = np.zeros((T, 2), dtype=np.int64)
    for t, (s, e) in enumerate(offsets):
        if special[t]:
            s = e = 0
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        tok[t] = (s, e)
    words = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    nonempty = tok[:, 1] > tok[:, 0]
    return (words[:, None, 0] < tok[None, :, 1]) & (tok[None, :, 0] < words[:, None, 1]) & nonempty[None, :]


_MARKERS = "\u2581\u0120 \t\n"  # SentencePiece's ▁, byte-level BPE's Ġ, white space


def _blank(tokenizer, token_id: int, cache: dict[int, bool]) -> bool:
    """A token that is only a space marker (``▁`` or ``Ġ`` alone) covers no word's characters, whatever
    its offsets say (a SentencePiece tokenizer maps a prepended ``▁`` onto the first character)."""
    if token_id not in cache:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        cache[token_id] = isinstance(piece, str) and piece != "" and not piece.strip(_MARKERS)
    return cache[token_id]


def align_sentences(tokenizer, sentences: Sequence[Sentence], *, max_positions: int | None = None):
    """Tokenise and align every sentence; returns ``(aligned, skipped)`` with ``skipped`` a list of
    ``(sent_id, reason)`` (too long for the model, a word that gets no token)."""
    check_fast(tokenizer)
    enc = tokenizer(
        [s.text for s in sentences],
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
        add_special_tokens=True,
        truncation=False,
        verbose=False,
    )
    sep_ids = {
        i for i in (getattr(tokenizer, "sep_token_id", None), getattr(tokenizer, "eos_token_id", None)) if i is not None
    }
    aligned, skipped = [], []
    blank_ids: dict[int, bool] = {}
    for k, s in enumerate(sentences):
        ids = np.asarray(enc["input_ids"][k], dtype=np.int64)
        if max_positions is not None and len(ids) > max_positions:
            skipped.append((s.sent_id, f"{len(ids)} tokens, more than the model's {max_positions} positions"))
            continue
        special = np.asarray(enc["special_tokens_mask"][k], dtype=bool)
        blank = np.asarray([_blank(tokenizer, int(i), blank_ids) for i in ids], dtype=bool)
        a_to = token_word_matrix(s.text, enc["offset_mapping"][k], special | blank, s.spans)
        empty = np.flatnonzero(~a_to.any(1))
        if len(empty):
            w = int(empty[0])
            skipped.append((s.sent_id, f"word {w + 1} ({s.words[w]!r}) gets no token from the tokenizer"))
            continue
        sep = special & np.isin(ids, list(sep_ids))
        sep[0] = False
        punct_words = np.asarray([u == "PUNCT" for u in s.upos])
        punct = a_to[punct_words].any(0) if punct_words.any() else np.zeros(len(ids), dtype=bool)
        aligned.append(Aligned(s, ids, a_to, special, sep, punct))
    return aligned, skipped


def word_attention(att: torch.Tensor, a_to: torch.Tensor) -> torch.Tensor:
    """Word-level attention ``A_from @ att @ A_to^T``.

    Args:
        att: ``(B, K, T, T)`` token attention (K = layers x heads).
        a_to: ``(B, N, T)`` 0/1 alignment (float); ``A_from`` is its rows divided by their sums
            (rows of padding words stay zero).

    Returns:
        ``(B, K, N, N)``: ``[b, k, i, j]`` = mean over word i's tokens of the sum over word j's tokens.
    """
    a_to = a_to.to(att.dtype)
    a_from = a_to / a_to.sum(-1, keepdim=True).clamp(min=1.0)
    return a_from[:, None] @ att @ a_to[:, None].transpose(-1, -2)


def predict(word_att: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The most-attended candidate word of each word: ``(B, K, N)`` long, ``-1`` where no candidate
    gets any attention (a decoder's first word, whose later words it cannot see).

    ``candidates (B, N, N)`` bool: word j may be predicted for word i (a real word, not i itself, and
    sharing no token with i).
    """
    x = word_att.masked_fill(~candidates[:, None], -1.0)
    val, idx = x.max(-1)
    return idx.masked_fill(val <= 0, -1)


@dataclass
class Batch:
    """Padded tensors of a few aligned sentences (B sentences, T tokens, N words)."""

    items: list[Aligned]
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T) 1 = real token
    a_to: torch.Tensor  # (B, N, T) float 0/1
    word_valid: torch.Tensor  # (B, N) bool
    heads: torch.Tensor  # (B, N) long, -1 = root or padding
    rels: torch.Tensor  # (B, N) long relation id, -1 = root or padding
    candidates: torch.Tensor  # (B, N, N) bool
    sep: torch.Tensor  # (B, T) bool
    punct: torch.Tensor  # (B, T) bool


def make_batch(items: Sequence[Aligned], rel_index: dict[str, int], pad_id: int) -> Batch:
    B = len(items)
    T = max(a.n_tokens for a in items)
    N = max(len(a.sentence) for a in items)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    a_to = torch.zeros(B, N, T)
    heads = torch.full((B, N), -1, dtype=torch.long)
    rels = torch.full((B, N), -1, dtype=torch.long)
    valid = torch.zeros(B, N, dtype=torch.bool)
    sep = torch.zeros(B, T, dtype=torch.bool)
    punct = torch.zeros(B, T, dtype=torch.bool)
    for b, a in enumerate(items):
        t, n = a.n_tokens, len(a.sentence)
        ids[b, :t] = torch.from_numpy(a.ids)
        mask[b, :t] = 1
        a_to[b, :n, :t] = torch.from_numpy(a.a_to.astype(np.float32))
        heads[b, :n] = torch.from_numpy(a.sentence.heads)
        rels[b, :n] = torch.tensor([rel_index.get(r, -1) if r != ROOT else -1 for r in a.sentence.relations])
        valid[b, :n] = True
        sep[b, :t] = torch.from_numpy(a.sep)
        punct[b, :t] = torch.from_numpy(a.punct)
    share = (a_to @ a_to.transpose(1, 2)) > 0  # (B, N, N): words i, j share a token (i == j included)
    candidates = valid[:, None, :] & valid[:, :, None] & ~share
    return Batch(list(items), ids, mask, a_to, valid, heads, rels, candidates, sep, punct)


def score(pred: torch.Tensor, batch: Batch, n_rel: int) -> torch.Tensor:
    """Correct predictions per relation: ``(2, K, R)`` float, direction 0 = dependent -> head (the word's
    prediction is its head), 1 = head -> dependent (the prediction is one of its dependents with
    relation r, credited to r)."""
    B, K, N = pred.shape
    out = torch.zeros(2, K, n_rel + 1)
    junk = n_rel  # column for root/padding, dropped at the end
    # dependent -> head
    gold = batch.heads[:, None, :].expand(B, K, N)
    ok = (pred == gold) & (gold >= 0)
    rel = batch.rels[:, None, :].expand(B, K, N).clamp(min=-1).masked_fill(batch.rels[:, None, :] < 0, junk)
    out[0].scatter_add_(1, rel.permute(1, 0, 2).reshape(K, -1), ok.float().permute(1, 0, 2).reshape(K, -1))
    # head -> dependent
    p = pred.clamp(min=0)
    head_of_p = torch.gather(batch.heads[:, None, :].expand(B, K, N), 2, p)
    rel_of_p = torch.gather(batch.rels[:, None, :].expand(B, K, N), 2, p)
    me = torch.arange(N)[None, None, :]
    ok = (pred >= 0) & (head_of_p == me) & batch.word_valid[:, None, :] & (rel_of_p >= 0)
    rel = rel_of_p.masked_fill(~ok, junk)
    out[1].scatter_add_(1, rel.permute(1, 0, 2).reshape(K, -1), ok.float().permute(1, 0, 2).reshape(K, -1))
    return out[:, :, :n_rel]


__all__ = [
    "Aligned",
    "Batch",
    "align_sentences",
    "check_fast",
    "make_batch",
    "predict",
    "score",
    "token_word_matrix",
    "word_attention",
]
