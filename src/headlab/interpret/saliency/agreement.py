"""How much two explanations agree: Kendall's tau (and its p-value) and Spearman's rho, per pair.

Jain and Wallace 2019 compare attention with gradient and leave-one-out importance by Kendall's
tau over the tokens of each instance. Here both coefficients come from scipy
(``scipy.stats.kendalltau``, tau-b, and ``scipy.stats.spearmanr``), over the non-special tokens
unless asked otherwise, and by default on magnitudes (``|score|``, as Jain and Wallace rank
gradients); ``magnitude=False`` ranks the signed scores.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field

import numpy as np


@dataclass
class PairAgreement:
    """Agreement of two methods on one input (NaN where a ranking is constant or has < 2 tokens)."""

    a: str
    b: str
    kendall_tau: float
    kendall_p: float
    spearman: float
    spearman_p: float
    n: int  # tokens compared

    def to_json(self) -> dict:
        clean = lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else v
        return {
            "a": self.a,
            "b": self.b,
            "kendall_tau": clean(self.kendall_tau),
            "kendall_p": clean(self.kendall_p),
            "spearman": clean(self.spearman),
            "spearman_p": clean(self.spearman_p),
            "n": self.n,
        }


@dataclass
class Agreement:
    """Every pair of methods; ``matrix("kendall_tau")`` gives the square table."""

    methods: list[str]
    pairs: dict[tuple[str, str], PairAgreement] = field(default_factory=dict)
    magnitude: bool = True
    include_special: bool = False

    def __getitem__(self, key: tuple[str, str]) -> PairAgreement:
        a, b = key
        return self.pairs[(a, b)] if (a, b) in self.pairs else self.pairs[(b, a)]

    def matrix(self, stat: str = "kendall_tau") -> list[list[float]]:
        """``[[stat(a, b) for b in methods] for a in methods]`` (1 on the diagonal)."""
        return [[1.0 if a == b else getattr(self[a, b], stat) for b in self.methods] for a in self.methods]

    def to_json(self) -> dict:
        return {
            "methods": self.methods,
            "magnitude": self.magnitude,
            "include_special": self.include_special,
            "pairs": [p.to_json() for p in self.pairs.values()],
        }


def rank_agreement(x, y) -> tuple[float, float, float, float]:
    """``(kendall_tau, kendall_p, spearman, spearman_p)`` of two score vectors (NaN when undefined)."""
    from scipy import stats

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return (math.nan,) * 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kt = stats.kendalltau(x, y)
        sp = stats.spearmanr(x, y)
    return float(kt.statistic), float(kt.pvalue), float(sp.statistic), float(sp.pvalue)


def agreement(
    scores: dict[str, list[float]], keep: list[bool], *, magnitude: bool = True, include_special: bool = False
) -> Agreement:
    """Pairwise agreement of ``scores`` over the positions where ``keep`` is True (see the module docstring)."""
    methods = list(scores)
    out = Agreement(methods, magnitude=magnitude, include_special=include_special)
    idx = [i for i, k in enumerate(keep) if k]
    for a, b in itertools.combinations(methods, 2):
        x = np.asarray(scores[a], dtype=float)[idx]
        y = np.asarray(scores[b], dtype=float)[idx]
        if magnitude:
            x, y = np.abs(x), np.abs(y)
        out.pairs[(a, b)] = PairAgreement(a, b, *rank_agreement(x, y), n=len(idx))
    return out
