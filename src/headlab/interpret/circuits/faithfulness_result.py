"""The result of :func:`~headlab.interpret.circuits.evaluation.faithfulness`: :class:`Faithfulness`, the curve over
circuit sizes with its baselines, MIB's CPR and CMD (defined in :mod:`headlab.interpret.circuits.evaluation`), its
table, and its file through :mod:`headlab.results`.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from pathlib import Path

from headlab.errors import InputError
from headlab.results import Result


@dataclass
class Faithfulness:
    """The faithfulness curve of one ranking (or one circuit) and its baselines; lists run over :attr:`sizes`.

    Attributes:
        model, metric, n_examples: what was evaluated. source: ``"eap-ig scores"``, ``"acdc circuit"``, ...
        ablation: what edges outside a circuit carry. n_graph_edges: edges of the whole graph.
        sizes: edges asked for (``k``). fractions: the x axis of CPR and CMD. kept: edges left after pruning.
        values: ``m(C)`` (mean over pairs; over seeds too). f: normalised faithfulness (module docstring).
        random_mean, random_sd: ``f`` of ``random`` random circuits of each size (None entries with random=0).
        full, empty: ``m(full)``, ``m(empty)``. clean, corrupted: the metric on the plain runs.
        cpr, cmd: MIB's areas (None with fewer than two sizes). absolute: how edges were ranked.
        by_template: ``{template: f per size}`` (None without templates). seed_sd: sd of ``f`` over resample seeds
        (None with one seed). seeds: the seeds used. seconds, notes.
    """

    model: str
    metric: str
    source: str
    ablation: str
    n_examples: int
    n_graph_edges: int
    sizes: list[int]
    fractions: list[float]
    kept: list[int]
    values: list[float]
    f: list[float]
    random: int
    random_mean: list[float | None]
    random_sd: list[float | None]
    full: float
    empty: float
    clean: float
    corrupted: float
    cpr: float | None = None
    cmd: float | None = None
    absolute: bool = True
    by_template: dict[str, list[float]] | None = None
    seed_sd: list[float] | None = None
    seeds: list[int] = field(default_factory=lambda: [0])
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    kind = "circuit_faithfulness"

    @property
    def curve(self) -> list[tuple[float, float]]:
        """``[(fraction, f)]``."""
        return list(zip(self.fractions, self.f))

    def table(self, digits: int = 3) -> str:
        """A compact text table: one row per size, then CPR and CMD."""
        d = digits
        cols = ["fraction", "edges", "kept", "m(C)", "f", "random f"]
        if self.seed_sd is not None:
            cols.append("seed sd")
        if self.by_template:
            cols.append("f by template (min..max)")
        rows = []
        for i, k in enumerate(self.sizes):
            rm, rs = self.random_mean[i], self.random_sd[i]
            row = [
                f"{self.fractions[i]:.4g}",
                str(k),
                str(self.kept[i]),
                f"{self.values[i]:.{d}g}",
                f"{self.f[i]:.{d}f}",
                "-" if rm is None else f"{rm:.{d}f} ± {rs:.{d}f}",
            ]
            if self.seed_sd is not None:
                row.append(f"{self.seed_sd[i]:.{d}f}")
            if self.by_template:
                per = [v[i] for v in self.by_template.values() if v[i] == v[i]]
                row.append(f"{min(per):.{d}f}..{max(per):.{d}f}" if per else "-")
            rows.append(row)
        width = [max(len(c), *(len(r[j]) for r in rows)) for j, c in enumerate(cols)]
        line = lambda r: "  ".join(v.rjust(w) for v, w in zip(r, width))
        out = [
            f"circuit faithfulness of {self.source} on {self.model}: {self.n_graph_edges} edges, "
            f"{self.n_examples} pairs, ablation {self.ablation}, metric {self.metric} "
            f"(full {self.full:.4g}, all ablated {self.empty:.4g})",
            line(cols),
        ] + [line(r) for r in rows]
        if self.cpr is not None:
            out.append(
                f"CPR {self.cpr:.{d}f} (area under f; higher is better)   "
                f"CMD {self.cmd:.{d}f} (area under |1 - f|; lower is better)"
            )
        return "\n".join(out)

    def to_result(self) -> Result:
        settings = {
            "source": self.source,
            "ablation": self.ablation,
            "metric": self.metric,
            "random": self.random,
            "absolute": self.absolute,
            "seeds": self.seeds,
        }
        figures = {
            "n_examples": self.n_examples,
            "n_graph_edges": self.n_graph_edges,
            "sizes": self.sizes,
            "fractions": self.fractions,
            "kept": self.kept,
            "values": _nums(self.values),
            "f": _nums(self.f),
            "random_mean": _nums(self.random_mean),
            "random_sd": _nums(self.random_sd),
            "full": self.full,
            "empty": self.empty,
            "clean": self.clean,
            "corrupted": self.corrupted,
            "cpr": self.cpr,
            "cmd": self.cmd,
            "by_template": None if self.by_template is None else {k: _nums(v) for k, v in self.by_template.items()},
            "seed_sd": None if self.seed_sd is None else _nums(self.seed_sd),
            "seconds": self.seconds,
            "notes": self.notes,
        }
        return Result(self.kind, model=self.model, settings=settings, figures=figures)

    def save(self, path: str | os.PathLike) -> Path:
        return self.to_result().save(path)

    @classmethod
    def from_result(cls, r: Result) -> Faithfulness:
        if r.kind != cls.kind:
            raise InputError(f"this file holds a {r.kind!r} result, not circuit faithfulness")
        f, s = r.figures, r.settings
        back = lambda v: [float("nan") if x is None else x for x in v]
        try:
            return cls(
                model=r.model or "",
                metric=s.get("metric", "metric"),
                source=s.get("source", ""),
                ablation=s.get("ablation", "patch"),
                n_examples=int(f["n_examples"]),
                n_graph_edges=int(f["n_graph_edges"]),
                sizes=[int(k) for k in f["sizes"]],
                fractions=[float(x) for x in f["fractions"]],
                kept=[int(k) for k in f["kept"]],
                values=back(f["values"]),
                f=back(f["f"]),
                random=int(s.get("random", 0)),
                random_mean=list(f["random_mean"]),
                random_sd=list(f["random_sd"]),
                full=float(f["full"]),
                empty=float(f["empty"]),
                clean=float(f["clean"]),
                corrupted=float(f["corrupted"]),
                cpr=f.get("cpr"),
                cmd=f.get("cmd"),
                absolute=bool(s.get("absolute", True)),
                by_template=None if f.get("by_template") is None else {k: back(v) for k, v in f["by_template"].items()},
                seed_sd=None if f.get("seed_sd") is None else back(f["seed_sd"]),
                seeds=[int(x) for x in s.get("seeds", [0])],
                seconds=float(f.get("seconds", 0.0)),
                notes=list(f.get("notes", [])),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(
                f"this faithfulness file lacks or garbles {e}; write it again with Faithfulness.save"
            ) from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> Faithfulness:
        return cls.from_result(Result.load(path, what="a circuit-faithfulness file headlab wrote"))

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.table())}</pre>"

    def __repr__(self) -> str:
        areas = "" if self.cpr is None else f", CPR {self.cpr:.3g}, CMD {self.cmd:.3g}"
        return f"Faithfulness({self.model}, {self.source}, {len(self.sizes)} sizes{areas})"


def _nums(v):
    return [None if x is None or x != x else float(x) for x in v]


__all__ = ["Faithfulness"]
