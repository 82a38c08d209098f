"""The syntactic kind's causal task: the model's own prediction of the words in the treebank's relations.

A syntactic head is scored by the probe (Clark et al. 2019): how often the word it attends to most is
the word's gold head (or dependent) for some relation. The check asks whether the model *uses* those
heads for the same words. Its task, for a model with a language-model head (a causal decoder such as
SmolLM2):

1. *relations*: for each of the top-k syntactic heads, the relation on which its accuracy margin over
   the fixed-offset baseline is largest (its score: either direction, relations with at least the probe's
   ``min_count`` cases); R is the set of these relations (:func:`head_relations`);
2. *targets*: in each treebank sentence the probe read (the first ``treebank_limit``, tokenised and
   aligned to words by :func:`headlab.interpret.probing.align.align_sentences`, special tokens included),
   the first token of every word whose relation (DEPREL) is in R: every dependent of those relations.
   A token is left out when it is the sequence's first (nothing to its left to predict it from) or is
   shared with another word (its prediction is not the word's own);
3. *metric* per sentence: the mean next-token negative log-likelihood (nats per token) of its targets,
   each predicted from its left context (the logits one position before), :func:`.causal.target_loss`;
   a sentence without a target is not an example. The effect of gating is the loss's increase.

An encoder (or a decoder without a language-model head) makes no prediction of a word from its left
context, so its syntactic label is scored but not checked (``Atlas.skipped["syntactic check"]`` says
why; a masked LM's prediction of a word from both sides would be another task, not built here).

    >>> import torch
    >>> ex = [Example("a", torch.arange(5), (1, 3)), Example("b", torch.arange(3), (2,))]
    >>> inputs, targets = next(batches(ex, pad_id=0, max_rows=8))
    >>> inputs["input_ids"].shape, targets.nonzero().tolist()
    (torch.Size([2, 5]), [[0, 1], [0, 3], [1, 2]])
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from headlab.interpret.probing.align import align_sentences
from headlab.interpret.probing.treebank import read_treebank

NO_LM = (
    "not run: the task is a causal language model's own prediction of each dependent's first token from its "
    "left context, and this model makes none (an encoder, or a decoder without a language-model head; a "
    "masked LM's prediction from both sides is another task, not built); the label rests on the probe's "
    "accuracy margin alone"
)


@dataclass(frozen=True)
class Example:
    """One sentence of the task: its token ids (specials included) and the positions of its targets."""

    sent_id: str
    ids: torch.Tensor
    targets: tuple[int, ...]


def head_relations(margin: torch.Tensor, names: list[str]) -> dict[str, str]:
    """``{"l.h": relation}``: each head's relation of largest margin. ``margin`` ``(2, L, H, R)`` with
    ``-inf`` where a relation has too few cases; heads with no such relation are left out."""
    _, L, H, R = margin.shape
    flat = margin.permute(1, 2, 0, 3).reshape(L, H, 2 * R)
    best, arg = flat.max(-1)
    return {
        f"{l}.{h}": names[int(arg[l, h]) % R] for l in range(L) for h in range(H) if math.isfinite(float(best[l, h]))
    }


def examples(tokenizer, treebank, *, limit: int | None, relations, max_positions: int | None) -> list[Example]:
    """The sentences of ``treebank`` (its first ``limit``) with at least one target: the first token of a
    word whose relation is in ``relations``, not at position 0 and belonging to that word alone. Sorted by
    token count (file order among equal counts), so that a batch pads little."""
    tb = read_treebank(treebank, limit=limit)
    items, _ = align_sentences(tokenizer, tb.sentences, max_positions=max_positions)
    wanted = set(relations)
    out = []
    for a in items:
        owners = a.a_to.sum(0)  # (T,) words each token belongs to
        targets = set()
        for w, rel in enumerate(a.sentence.relations):
            if rel in wanted:
                t = int(a.a_to[w].argmax())  # its first token (every aligned word has one)
                if t >= 1 and owners[t] == 1:
                    targets.add(t)
        if targets:
            out.append(Example(a.sentence.sent_id, torch.as_tensor(a.ids, dtype=torch.long), tuple(sorted(targets))))
    return sorted(out, key=lambda e: len(e.ids))


def batches(
    items: list[Example], *, pad_id: int, max_rows: int, max_tokens: int = 4096
) -> Iterator[tuple[dict, torch.Tensor]]:
    """Consecutive examples, right-padded, at most ``max_rows`` of them and about
    ``max_tokens`` tokens per batch: ``(inputs, targets)``, ``targets`` ``(B, L)`` bool."""
    group: list[Example] = []

    def emit():
        L = max(len(e.ids) for e in group)
        ids = torch.full((len(group), L), pad_id, dtype=torch.long)
        att = torch.zeros(len(group), L, dtype=torch.long)
        tgt = torch.zeros(len(group), L, dtype=torch.bool)
        for i, e in enumerate(group):
            ids[i, : len(e.ids)], att[i, : len(e.ids)] = e.ids, 1
            tgt[i, list(e.targets)] = True
        return {"input_ids": ids, "attention_mask": att}, tgt

    for e in items:
        L = max([len(e.ids)] + [len(g.ids) for g in group])
        if group and (len(group) >= max_rows or (len(group) + 1) * L > max_tokens):
            yield emit()
            group = []
        group.append(e)
    if group:
        yield emit()


def task_name(relations: list[str]) -> str:
    return (
        f"loss on the dependents of {', '.join(relations)} (nats per first token of each such word, predicted "
        "from its left context; treebank sentences)"
    )


__all__ = ["NO_LM", "Example", "batches", "examples", "head_relations", "task_name"]
