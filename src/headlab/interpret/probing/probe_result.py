"""What :func:`headlab.probe` returns: :class:`ProbeResult`, its tables, exports and head labels.

The result holds arrays (accuracy per direction, layer, head and relation; counts; baselines;
per-head measurements) and derives every table from them, so the CSV, the JSON, the figures and the
page never disagree. ``ProbeResult.load(path)`` reads back what ``save_json`` wrote, and
:func:`head_annotations` turns either into short labels for ``headlab analyze --probe``.
"""

from __future__ import annotations

import csv
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from headlab.errors import InputError
from headlab.interpret.probing.gold import DIRECTIONS
from headlab.interpret.probing.treebank import Skipped
from headlab.results import envelope, write_json

# per-head measurements (Clark et al. 2019, section 3), each (n_layers, n_heads)
MEASURES = {
    "to_first": "mean attention to the first token ([CLS], or BOS / the first word for decoders)",
    "to_sep": "mean attention to [SEP] / EOS tokens (None when the tokenizer adds none)",
    "to_punct": "mean attention to punctuation tokens (words with UPOS PUNCT)",
    "to_next": "mean attention to the next token",
    "to_prev": "mean attention to the previous token",
    "to_self": "mean attention to the token itself",
    "entropy": "mean entropy of a token's attention distribution, in nats",
    "grad_sep": "mean |d loss / d attention| on attention to [SEP] (decoders: to the first token)",
    "grad_other": "mean |d loss / d attention| on attention to every other token",
    "grad_first": "mean |d loss / d attention| on attention to the first token ([CLS]; decoders: = grad_sep)",
}


def _nan_to_none(x):
    """Nested lists with NaN (a head a pruned layer lacks) as None, so the JSON stays standard."""
    return [_nan_to_none(v) for v in x] if isinstance(x, list) else _f(x)


@dataclass(frozen=True)
class RelationRow:
    """One (relation, direction, layer, head) cell of the study."""

    relation: str
    direction: str
    layer: int
    head: int
    accuracy: float  # share of the cases the head gets right (a fraction)
    count: int  # cases of this relation and direction
    baseline_offset: int
    baseline_accuracy: float
    visible: float  # share of the cases a causal model can see (1.0 for an encoder)


@dataclass(frozen=True)
class Baseline:
    """The best fixed offset for one relation and direction."""

    relation: str
    direction: str
    offset: int
    accuracy: float
    count: int
    visible: float  # share of cases a causal model can see (answer before the asking word)


@dataclass(frozen=True)
class BestHead:
    """The head with the highest accuracy for one relation and direction."""

    relation: str
    direction: str
    layer: int
    head: int
    accuracy: float
    baseline_offset: int
    baseline_accuracy: float
    count: int
    visible: float  # share of the cases a causal model can see (1.0 for an encoder)

    @property
    def margin(self) -> float:
        return self.accuracy - self.baseline_accuracy


@dataclass(frozen=True)
class LayerMeasures:
    """Clark et al.'s surface measurements averaged over the heads of one layer (None: not measured)."""

    layer: int
    to_first: float | None
    to_sep: float | None
    to_punct: float | None
    to_next: float | None
    to_prev: float | None
    to_self: float | None
    entropy: float | None
    grad_sep: float | None
    grad_other: float | None
    grad_first: float | None


def _f(x) -> float | None:
    return None if x is None or (isinstance(x, float) and np.isnan(x)) else float(x)


@dataclass
class ProbeResult:
    """Heads against gold dependency trees (see :mod:`headlab.interpret.probing`).

    Arrays: ``accuracy (2, n_layers, n_heads, R)``, ``count``, ``visible``, ``baseline_accuracy``,
    ``baseline_offset`` ``(2, R)``; direction 0 is ``dep->head``, 1 ``head->dep``; ``relation_names``
    order the last axis (most frequent first). ``per_head[name]`` is ``(n_layers, n_heads)`` for each
    name in :data:`MEASURES` (NaN where not measured). ``head_map`` is ``(n_layers * n_heads, 2)``
    (layer-major) or None. A head that a pruned model's layer lacks is NaN in every array (``null`` in JSON).
    """

    model: str
    family: str
    causal: bool
    treebank: str
    n_layers: int
    n_heads: int
    sentences: int
    tokens: int
    relation_names: list[str]
    accuracy: np.ndarray
    count: np.ndarray
    visible: np.ndarray
    baseline_accuracy: np.ndarray
    baseline_offset: np.ndarray
    per_head: dict[str, np.ndarray]
    skipped: list[Skipped] = field(default_factory=list)
    head_map: np.ndarray | None = None
    head_map_sentences: int = 0
    grad_note: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    fold_subtypes: bool = False
    min_count: int = 10  # a relation needs this many cases before a head can "beat the baseline" on it

    # ---- tables -----------------------------------------------------------------------------------

    def _repr_html_(self) -> str:
        """This result's page inline in a notebook (headlab's shell in a sandboxed frame; no network)."""
        import tempfile
        from pathlib import Path

        from headlab.interpret import shell
        from headlab.interpret.probing.render import head_map_png, heatmap_png, render_html

        with tempfile.TemporaryDirectory() as tmp:  # the pictures are written, then embedded in the page
            page = render_html(self, heatmap_png(self, Path(tmp) / "h.png"), head_map_png(self, Path(tmp) / "m.png"))
        return shell.inline(page, height=900)

    def _rel(self, relation: str) -> int:
        try:
            return self.relation_names.index(relation)
        except ValueError:
            raise InputError(
                f"relation {relation!r} is not in this result; it has: {', '.join(self.relation_names)}"
            ) from None

    @property
    def relations(self) -> list[RelationRow]:
        """The whole table: one row per relation, direction, layer and head."""
        rows = []
        for r, name in enumerate(self.relation_names):
            for d, direction in enumerate(DIRECTIONS):
                off, base, cnt = (
                    int(self.baseline_offset[d, r]),
                    float(self.baseline_accuracy[d, r]),
                    int(self.count[d, r]),
                )
                vis = self._visible(d, r) if self.causal else 1.0
                for layer in range(self.n_layers):
                    for h in range(self.n_heads):
                        if np.isnan(self.accuracy[d, layer, h, r]):
                            continue  # a head a pruned layer does not have
                        rows.append(
                            RelationRow(
                                name, direction, layer, h, float(self.accuracy[d, layer, h, r]), cnt, off, base, vis
                            )
                        )
        return rows

    @property
    def baselines(self) -> list[Baseline]:
        return [
            Baseline(
                name,
                direction,
                int(self.baseline_offset[d, r]),
                float(self.baseline_accuracy[d, r]),
                int(self.count[d, r]),
                self._visible(d, r),
            )
            for r, name in enumerate(self.relation_names)
            for d, direction in enumerate(DIRECTIONS)
        ]

    def _visible(self, d: int, r: int) -> float:
        c = self.count[d, r]
        return float(self.visible[d, r] / c) if c else 0.0

    @property
    def best_heads(self) -> list[BestHead]:
        """One per relation and direction with cases: the most accurate head (ties: the lowest layer, head)."""
        out = []
        for r, name in enumerate(self.relation_names):
            for d, direction in enumerate(DIRECTIONS):
                if not self.count[d, r]:
                    continue
                acc = self.accuracy[d, :, :, r]
                layer, h = np.unravel_index(int(np.nanargmax(acc)), acc.shape)  # NaN: a pruned head
                out.append(
                    BestHead(
                        name,
                        direction,
                        int(layer),
                        int(h),
                        float(acc[layer, h]),
                        int(self.baseline_offset[d, r]),
                        float(self.baseline_accuracy[d, r]),
                        int(self.count[d, r]),
                        self._visible(d, r) if self.causal else 1.0,
                    )
                )
        return out

    def best_head(self, relation: str, direction: str = "dep->head") -> BestHead:
        for b in self.best_heads:
            if b.relation == relation and b.direction == direction:
                return b
        self._rel(relation)
        raise InputError(f"relation {relation!r} has no {direction} cases")

    def seen_direction(self, relation: str) -> str:
        """The direction a causal model can answer more often (for an encoder: the one its best head
        does better on)."""
        r = self._rel(relation)
        if self.causal:
            return DIRECTIONS[int(np.argmax([self._visible(d, r) for d in range(2)]))]
        return DIRECTIONS[int(np.argmax(np.nanmax(self.accuracy[:, :, :, r].reshape(2, -1), axis=1)))]

    def heads_beating_baseline(
        self, *, min_margin: float = 0.0, min_count: int | None = None
    ) -> dict[tuple[int, int], list[BestHead]]:
        """Heads more accurate than the baseline (by more than ``min_margin``) on at least one relation
        with ``min_count`` cases (default :attr:`min_count`):
        ``{(layer, head): [one BestHead-shaped record per relation and direction it beats]}``.

        With many rare relations whose baselines are weak, almost every head beats some baseline by a
        little; ``min_margin=0.1, min_count=100`` asks for clear wins on common relations."""
        out: dict[tuple[int, int], list[BestHead]] = {}
        need = self.min_count if min_count is None else min_count
        for r, name in enumerate(self.relation_names):
            for d, direction in enumerate(DIRECTIONS):
                if self.count[d, r] < need:
                    continue
                base = self.baseline_accuracy[d, r]
                for layer, h in zip(*np.nonzero(self.accuracy[d, :, :, r] > base + min_margin)):
                    out.setdefault((int(layer), int(h)), []).append(
                        BestHead(
                            name,
                            direction,
                            int(layer),
                            int(h),
                            float(self.accuracy[d, layer, h, r]),
                            int(self.baseline_offset[d, r]),
                            float(base),
                            int(self.count[d, r]),
                            self._visible(d, r) if self.causal else 1.0,
                        )
                    )
        return dict(sorted(out.items()))

    @property
    def per_layer(self) -> list[LayerMeasures]:
        m = {}
        for k in MEASURES:
            v = np.asarray(self.per_head.get(k, np.full((self.n_layers, self.n_heads), np.nan)), dtype=float)
            m[k] = np.full(self.n_layers, np.nan) if np.isnan(v).all() else np.nanmean(v, axis=1)
        return [LayerMeasures(i, *(_f(m[k][i]) for k in MEASURES)) for i in range(self.n_layers)]

    # ---- export -----------------------------------------------------------------------------------
    def summary(self) -> dict:
        """The ``headlab probe --json`` document: the best head of each relation and direction."""
        return {
            "model": self.model,
            "sentences": self.sentences,
            "skipped": len(self.skipped),
            "relations": [
                {
                    "relation": b.relation,
                    "direction": b.direction,
                    "layer": b.layer,
                    "head": b.head,
                    "accuracy": round(b.accuracy, 6),
                    "baseline_offset": b.baseline_offset,
                    "baseline_accuracy": round(b.baseline_accuracy, 6),
                    "count": b.count,
                }
                for b in self.best_heads
            ],
        }

    def to_json(self) -> dict:
        """Everything, JSON-ready, in the result envelope (:mod:`headlab.results`; ``ProbeResult.from_json``
        reads it back)."""
        settings = {
            "treebank": self.treebank,
            "fold_subtypes": self.fold_subtypes,
            "min_count": self.min_count,
            "head_map_sentences": self.head_map_sentences,
        }
        return envelope(
            "probe",
            {
                "kind": "headlab.probe",
                "model": self.model,
                "family": self.family,
                "causal": self.causal,
                "treebank": self.treebank,
                "n_layers": self.n_layers,
                "n_heads": self.n_heads,
                "sentences": self.sentences,
                "tokens": self.tokens,
                "seconds": round(self.seconds, 3),
                "fold_subtypes": self.fold_subtypes,
                "min_count": self.min_count,
                "directions": list(DIRECTIONS),
                "relation_names": self.relation_names,
                "notes": self.notes,
                "grad_note": self.grad_note,
                "skipped": [asdict(s) for s in self.skipped],
                "best_heads": [{**asdict(b), "margin": round(b.margin, 6)} for b in self.best_heads],
                "baselines": [asdict(b) for b in self.baselines],
                "per_layer": [asdict(x) for x in self.per_layer],
                "accuracy": _nan_to_none(np.round(self.accuracy, 6).tolist()),
                "count": self.count.tolist(),
                "visible": self.visible.tolist(),
                "baseline_accuracy": np.round(self.baseline_accuracy, 6).tolist(),
                "baseline_offset": self.baseline_offset.tolist(),
                "per_head": {k: [[_f(x) for x in row] for row in v.tolist()] for k, v in self.per_head.items()},
                "head_map": None if self.head_map is None else _nan_to_none(np.round(self.head_map, 6).tolist()),
                "head_map_sentences": self.head_map_sentences,
            },
            model=self.model,
            settings=settings,
        )

    @classmethod
    def from_json(cls, d: dict) -> ProbeResult:
        if d.get("kind") != "headlab.probe":
            raise InputError(
                "not a headlab probe result (no \"kind\": \"headlab.probe\"); give the relations.json "
                "that headlab probe wrote"
            )
        return cls(
            model=d["model"],
            family=d["family"],
            causal=d["causal"],
            treebank=d["treebank"],
            n_layers=d["n_layers"],
            n_heads=d["n_heads"],
            sentences=d["sentences"],
            tokens=d["tokens"],
            relation_names=d["relation_names"],
            accuracy=np.asarray(d["accuracy"], dtype=float),
            count=np.asarray(d["count"], dtype=float),
            visible=np.asarray(d["visible"], dtype=float),
            baseline_accuracy=np.asarray(d["baseline_accuracy"], dtype=float),
            baseline_offset=np.asarray(d["baseline_offset"], dtype=int),
            per_head={
                k: np.asarray([[np.nan if x is None else x for x in row] for row in v], dtype=float)
                for k, v in d["per_head"].items()
            },
            skipped=[Skipped(**s) for s in d["skipped"]],
            head_map=None if d["head_map"] is None else np.asarray(d["head_map"], dtype=float),
            head_map_sentences=d["head_map_sentences"],
            grad_note=d["grad_note"],
            seconds=d["seconds"],
            notes=d["notes"],
            fold_subtypes=d["fold_subtypes"],
            min_count=d["min_count"],
        )

    def save_json(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json(), indent=None, ensure_ascii=False)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ProbeResult:
        path = Path(path).expanduser()
        if not path.is_file():
            raise InputError(f"no probe result at {str(path)!r}; give the relations.json headlab probe wrote")
        from headlab.reading import read_json_file

        return cls.from_json(read_json_file(path, what="the relations.json headlab probe wrote"))

    def to_rows(self) -> list[dict]:
        """:attr:`relations` as dicts (one per relation, direction, layer, head)."""
        return [asdict(r) for r in self.relations]

    def to_frame(self):
        """:attr:`relations` as a pandas DataFrame (needs pandas)."""
        try:
            import pandas as pd
        except ModuleNotFoundError:
            raise InputError(
                "to_frame() needs pandas (`pip install pandas`); to_rows() gives the same table as a list of dicts"
            ) from None
        return pd.DataFrame(self.to_rows())

    def to_csv(self, path: str | os.PathLike) -> Path:
        """:attr:`relations` as CSV, accuracies as fractions."""
        path = Path(path)
        with path.open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(RelationRow.__dataclass_fields__))
            w.writeheader()
            for row in self.to_rows():
                w.writerow({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()})
        return path


def head_annotations(
    result_or_path: ProbeResult | str | os.PathLike, *, min_margin: float = 0.01
) -> dict[tuple[int, int], str]:
    """Labels for ``headlab analyze --probe``: ``{(layer, head): "det head: 78% vs offset baseline 41%"}``
    for the best head of each relation (``min_count`` cases or more) that beats its baseline by more
    than ``min_margin`` (default one point, so that no label reads "51% vs 51%"); a head that is best
    at several joins them with ``"; "``. A ``head->dep`` finding says so in brackets.
    """
    r = result_or_path if isinstance(result_or_path, ProbeResult) else ProbeResult.load(result_or_path)
    out: dict[tuple[int, int], list[str]] = {}
    for b in r.best_heads:
        if b.count < r.min_count or b.margin <= min_margin:
            continue
        tag = "" if b.direction == "dep->head" else " (head->dep)"
        out.setdefault((b.layer, b.head), []).append(
            f"{b.relation} head{tag}: {b.accuracy:.0%} vs offset baseline {b.baseline_accuracy:.0%}"
        )
    return {k: "; ".join(v) for k, v in sorted(out.items())}


__all__ = ["MEASURES", "Baseline", "BestHead", "LayerMeasures", "ProbeResult", "RelationRow", "head_annotations"]
