"""Results of the circuits room: edge scores and circuits, in the one envelope (:mod:`headlab.results`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from headlab.errors import InputError
from headlab.results import Result


@dataclass
class EdgeScores:
    """One score per edge: the (estimated or exact) change of the metric's mean when the edge carries the
    corrupted sender's contribution, everything else clean (``m_patched - m_clean``).

    Attributes:
        model, metric, n_examples: what was scored. method: ``"eap"``, ``"eap-ig"`` or ``"exact"``.
        clean, corrupted: the metric's means on the two runs. edges: names (``"a0.h1->a3.h2<q>"``), in the
        graph's order. values: ``(len(edges),)`` float64 (NaN: not measured). steps, ig: EAP-IG's.
        seconds: wall time. notes: what to know when reading the numbers.
    """

    model: str
    method: str
    metric: str
    n_examples: int
    clean: float
    corrupted: float
    edges: list[str]
    values: torch.Tensor
    steps: int = 1
    ig: str | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    kind = "edge_scores"

    @property
    def scores(self) -> dict[str, float]:
        """``{edge name: score}``."""
        return dict(zip(self.edges, self.values.tolist()))

    @property
    def gap(self) -> float:
        return self.corrupted - self.clean

    def top(self, k: int = 10) -> list[tuple[str, float]]:
        """The ``k`` edges with the largest ``|score|``, largest first."""
        v = torch.nan_to_num(self.values.abs(), nan=-1.0)
        order = torch.argsort(v, descending=True)[:k]
        return [(self.edges[i], float(self.values[i])) for i in order.tolist()]

    def to_result(self) -> Result:
        settings = {"method": self.method, "metric": self.metric, "steps": self.steps, "ig": self.ig}
        figures = {
            "n_examples": self.n_examples,
            "clean": self.clean,
            "corrupted": self.corrupted,
            "edges": self.edges,
            "scores": [None if v != v else v for v in self.values.tolist()],
            "seconds": self.seconds,
            "notes": self.notes,
        }
        return Result(self.kind, model=self.model, settings=settings, figures=figures)

    def save(self, path: str | os.PathLike):
        return self.to_result().save(path)

    @classmethod
    def from_result(cls, r: Result) -> EdgeScores:
        if r.kind != cls.kind:
            raise InputError(f"this file holds a {r.kind!r} result, not edge scores (headlab circuit scores ...)")
        f, s = r.figures, r.settings
        return cls(
            model=r.model or "",
            method=s.get("method", ""),
            metric=s.get("metric", ""),
            n_examples=int(f["n_examples"]),
            clean=float(f["clean"]),
            corrupted=float(f["corrupted"]),
            edges=list(f["edges"]),
            values=torch.tensor([float("nan") if v is None else v for v in f["scores"]], dtype=torch.float64),
            steps=int(s.get("steps") or 1),
            ig=s.get("ig"),
            seconds=float(f.get("seconds", 0.0)),
            notes=list(f.get("notes", [])),
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> EdgeScores:
        return cls.from_result(Result.load(path, what="an edge-scores file headlab wrote"))

    def __repr__(self) -> str:
        return (
            f"EdgeScores({self.model}, {self.method}, {len(self.edges)} edges, clean {self.clean:.4g}, "
            f"corrupted {self.corrupted:.4g}, top {self.top(1)})"
        )


def added_over_ranks(s: EdgeScores, n_pairs: int, placement) -> EdgeScores:
    """One rank's :class:`EdgeScores` of its share of the pairs, made the scores of all ``n_pairs``: every figure
    is a mean over pairs, so the ranks' figures are added weighted by their pairs (``placement.sum_over_data``; the
    same result on every rank)."""
    import dataclasses

    part = torch.cat(
        [
            s.values * s.n_examples,
            torch.tensor([s.clean, s.corrupted], dtype=torch.float64) * s.n_examples,
            torch.tensor([s.seconds], dtype=torch.float64),
        ]
    )
    total = placement.sum_over_data(part)
    values, clean, corrupted = total[:-3] / n_pairs, float(total[-3]) / n_pairs, float(total[-2]) / n_pairs
    notes = [
        *s.notes,
        f"pairs split across the ranks and their scores added (seconds: the ranks' sum, {float(total[-1]):.1f})",
    ]
    return dataclasses.replace(s, values=values, clean=clean, corrupted=corrupted, n_examples=n_pairs, notes=notes)


__all__ = ["EdgeScores", "added_over_ranks"]
