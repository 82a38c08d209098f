"""What the gold trees alone say: how many cases each relation has, which of them a causal model can
see, and the fixed-offset baselines. No model involved.

Two directions, as Clark et al. (2019, section 4.2) evaluate them:

- ``dep->head``: one case per word with relation r; a predictor is right when the word it picks
  is the word's head.
- ``head->dep``: one case per (word, relation r) where the word has at least one dependent with
  relation r; a predictor is right when the word it picks is one of those dependents.

A fixed offset ``o`` predicts the word ``o`` places away (``+1``: the next word). The baseline of a
relation and direction is the offset in :data:`OFFSETS` that is right most often, chosen on the same
sentences. A case is *visible* to a causal (decoder) model when its answer lies before the word
asking: the head before the dependent for ``dep->head``, a dependent before its head for ``head->dep``.

    >>> import numpy as np
    >>> from headlab.interpret.probing.treebank import Sentence
    >>> s = Sentence("s", "the cat sat", ("the", "cat", "sat"), np.array([1, 2, -1]),
    ...              ("det", "nsubj", "root"), ("DET", "NOUN", "VERB"), ((0, 3), (4, 7), (8, 11)), 1)
    >>> g = gold_counts([s], {"det": 0, "nsubj": 1})
    >>> g.count.tolist(), g.visible.tolist()
    ([[1.0, 1.0], [1.0, 1.0]], [[0.0, 0.0], [1.0, 1.0]])
    >>> g.correct[0, OFFSETS.index(1)].tolist(), g.correct[1, OFFSETS.index(-1)].tolist()
    ([1.0, 1.0], [1.0, 1.0])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from headlab.interpret.probing.treebank import ROOT, Sentence

DIRECTIONS = ("dep->head", "head->dep")
OFFSETS = tuple(o for o in range(-5, 6) if o != 0)  # the fixed offsets tried for the baseline


@dataclass
class GoldCounts:
    """``count (2, R)``, ``visible (2, R)``, ``correct (2, len(OFFSETS), R)`` (directions as in :data:`DIRECTIONS`)."""

    count: np.ndarray
    visible: np.ndarray
    correct: np.ndarray

    def __iadd__(self, other: GoldCounts) -> GoldCounts:
        self.count += other.count
        self.visible += other.visible
        self.correct += other.correct
        return self


def relation_ids(sentence: Sentence, rel_index: dict[str, int]) -> np.ndarray:
    """Each word's relation id, ``-1`` for the root and for relations not studied."""
    return np.asarray([rel_index.get(r, -1) if r != ROOT else -1 for r in sentence.relations], dtype=np.int64)


def gold_counts(sentences: Sequence[Sentence], rel_index: dict[str, int]) -> GoldCounts:
    """Cases, visible cases and offset-baseline hits per relation (see the module docstring)."""
    R = len(rel_index)
    g = GoldCounts(np.zeros((2, R)), np.zeros((2, R)), np.zeros((2, len(OFFSETS), R)))
    for s in sentences:
        h = s.heads
        r = relation_ids(s, rel_index)
        n = len(h)
        d = np.flatnonzero(r >= 0)  # dependents with a studied relation
        np.add.at(g.count[0], r[d], 1)
        np.add.at(g.visible[0], r[d], (h[d] < d).astype(float))
        units: dict = {}  # (head word, relation) -> visible
        for dep in d:
            key = (int(h[dep]), int(r[dep]))
            units[key] = units.get(key, False) or dep < h[dep]
        for (_, rel), vis in units.items():
            g.count[1, rel] += 1
            g.visible[1, rel] += vis
        idx = np.arange(n)
        for k, o in enumerate(OFFSETS):
            target = idx + o
            inside = (target >= 0) & (target < n)
            hit = inside & (r >= 0) & (h == target)
            np.add.at(g.correct[0, k], r[hit], 1)
            w = idx[inside]
            j = target[inside]
            back = (h[j] == w) & (r[j] >= 0)
            np.add.at(g.correct[1, k], r[j[back]], 1)
    return g


__all__ = ["DIRECTIONS", "OFFSETS", "GoldCounts", "gold_counts", "relation_ids"]
