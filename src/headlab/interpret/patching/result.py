"""The result of patching: :class:`PatchResult`, with its JSON, its table and its page.

Convention (the same for every method): an *effect* is the change of the metric's mean over examples
when the patch is applied to the clean run, divided by the clean/corrupted gap::

    effect = (m_patched - m_clean) / (m_corrupted - m_clean)

0 = the patch changes nothing; 1 = the patch alone turns the clean run's metric into the corrupted
run's; negative = it moves the metric the other way. ``raw`` holds the undivided change
``m_patched - m_clean``. (REFERENCES.md writes the reverse direction, corrupted run patched with clean
activations, normalised as ``(m_patched - m_corrupted) / (m_clean - m_corrupted)``; for the clean run
patched with corrupted activations the formula above is its mirror image: both read 1 as "this site
carries the whole difference".)
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import numpy as np
import torch

from headlab.results import envelope

CONVENTION = "(m_patched - m_clean) / (m_corrupted - m_clean): 0 = no change, 1 = the whole clean/corrupted gap"


def normalise(raw: torch.Tensor, clean: float, corrupted: float) -> torch.Tensor:
    gap = corrupted - clean
    if abs(gap) < 1e-9:
        return torch.full_like(raw, float("nan"))
    return raw / gap


@dataclass
class PatchResult:
    """Per-head effects of one patching method. Grids are ``(n_layers, heads)`` (heads = kv heads for k and v),
    or ``(n_layers, heads, P)`` with ``positions``; NaN where a head was not measured.

    Attributes:
        model: the model's name. method: ``"exact"``, ``"attribution"`` or ``"path"``.
        metric: the metric's name. n_examples: B. clean, corrupted: the metric's means on the two runs.
        effects: ``{kind: grid}`` normalised as :data:`CONVENTION`. raw: ``{kind: grid}`` of ``m_patched - m_clean``.
        positions: the positions patched one at a time, or None (all positions at once).
        receivers: for path patching, the receiving heads ``[(layer, head)]`` and their input (``"q"`` ...).
        seconds: wall time of the method. notes: what to know when reading the numbers.
    """

    model: str
    method: str
    metric: str
    n_examples: int
    clean: float
    corrupted: float
    effects: dict[str, torch.Tensor]
    raw: dict[str, torch.Tensor]
    positions: list[int] | None = None
    receivers: dict | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def gap(self) -> float:
        return self.corrupted - self.clean

    def head_effects(self, kind: str = "z") -> torch.Tensor:
        """``(n_layers, heads)``: the effect per head (summed over positions when patched one at a time)."""
        e = self.effects[kind]
        return e if e.dim() == 2 else e.nansum(-1)

    def top(self, k: int = 10, kind: str = "z") -> list[tuple[int, int, float]]:
        """The ``k`` heads with the largest ``|effect|``: ``[(layer, head, effect), ...]``."""
        e = self.head_effects(kind)
        flat = torch.nan_to_num(e.abs(), nan=-1.0).flatten()
        order = torch.argsort(flat, descending=True)[:k]
        H = e.shape[1]
        return [(int(i) // H, int(i) % H, float(e.flatten()[i])) for i in order if flat[i] >= 0]

    def table(self, kind: str = "z", digits: int = 2) -> str:
        """A plain-text grid: one row per layer, one column per head."""
        e = self.head_effects(kind)
        H = e.shape[1]
        w = digits + 5
        lines = [
            f"{self.method} patching of {kind}: effect {CONVENTION}",
            "layer " + "".join(f"{h:>{w}}" for h in range(H)),
        ]
        for l in range(e.shape[0]):
            cells = "".join(f"{'.':>{w}}" if np.isnan(v) else f"{v:>{w}.{digits}f}" for v in e[l].tolist())
            lines.append(f"{l:>5} " + cells)
        return "\n".join(lines)

    def to_json(self) -> dict:
        def arr(t):
            a = t.double().numpy()
            return np.where(np.isnan(a), None, np.round(a, 6)).tolist()

        settings = {
            "method": self.method,
            "metric": self.metric,
            "positions": self.positions,
            "receivers": self.receivers,
        }
        return envelope(
            "patching",
            {
                "kind_of_result": "patching",
                "model": self.model,
                "method": self.method,
                "metric": self.metric,
                "convention": CONVENTION,
                "n_examples": self.n_examples,
                "clean": self.clean,
                "corrupted": self.corrupted,
                "positions": self.positions,
                "receivers": self.receivers,
                "effects": {k: arr(v) for k, v in self.effects.items()},
                "raw": {k: arr(v) for k, v in self.raw.items()},
                "top": {k: [list(t) for t in self.top(10, k)] for k in self.effects},
                "seconds": self.seconds,
                "notes": self.notes,
            },
            model=self.model,
            settings=settings,
        )

    @classmethod
    def from_json(cls, data: dict) -> PatchResult:
        """The result :meth:`to_json` wrote (grids to 6 decimals, None where a head was not measured, as NaN)."""

        def grid(rows) -> torch.Tensor:
            return torch.tensor(np.array(rows, dtype=float), dtype=torch.float64)

        return cls(
            model=data["model"],
            method=data["method"],
            metric=data["metric"],
            n_examples=data["n_examples"],
            clean=data["clean"],
            corrupted=data["corrupted"],
            effects={k: grid(v) for k, v in data["effects"].items()},
            raw={k: grid(v) for k, v in data["raw"].items()},
            positions=data.get("positions"),
            receivers=data.get("receivers"),
            seconds=data.get("seconds", 0.0),
            notes=list(data.get("notes", [])),
        )

    def html(self) -> str:
        """The page body: one heatmap table per site kind (blue = towards the corrupted run, red = away)."""
        parts = []
        for kind in self.effects:
            e = self.head_effects(kind)
            scale = float(torch.nan_to_num(e.abs(), nan=0.0).max()) or 1.0
            head = "".join(f"<th>{h}</th>" for h in range(e.shape[1]))
            rows = []
            for l in range(e.shape[0]):
                cells = []
                for h, v in enumerate(e[l].tolist()):
                    if np.isnan(v):
                        cells.append("<td></td>")
                        continue
                    a = min(1.0, abs(v) / scale)
                    rgb = "49,99,206" if v > 0 else "206,60,49"
                    cells.append(f'<td style="background: rgba({rgb},{a:.2f})" title="{l}.{h}: {v:.4f}">{v:.2f}</td>')
                rows.append(f"<tr><th>{l}</th>{''.join(cells)}</tr>")
            parts.append(
                f"<h2>{html.escape(kind)}</h2><table class=\"grid\"><tr><th>layer</th>{head}</tr>"
                f"{''.join(rows)}</table>"
            )
        return "\n".join(parts)

    def page(self) -> str:
        from headlab.interpret import shell

        lines = [
            f"{self.method} patching, metric {self.metric}, {self.n_examples} examples",
            f"clean {self.clean:.4f}, corrupted {self.corrupted:.4f}; effect = {CONVENTION}",
            *self.notes,
        ]
        return shell.page(
            title=f"patching: {self.model}",
            body=self.html(),
            summary_lines=lines,
            data=self.to_json(),
            generator="headlab patch",
        )

    def _repr_html_(self) -> str:
        """This result's page inline in a notebook (headlab's shell in a sandboxed frame; no network)."""
        from headlab.interpret import shell

        return shell.inline(self.page())

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k} {tuple(v.shape)}" for k, v in self.effects.items())
        return (
            f"PatchResult({self.method}, {self.model}, clean {self.clean:.4g}, corrupted {self.corrupted:.4g}; {kinds})"
        )


def compare(exact: PatchResult, approx: PatchResult, kind: str = "z", k: int = 10) -> dict:
    """How well ``approx`` (e.g. attribution patching) ranks heads as ``exact`` does: Spearman and Pearson over
    the heads measured by both, and the overlap of their top-``k`` heads by ``|effect|``."""
    from scipy.stats import pearsonr, spearmanr

    a, b = exact.effects[kind].flatten().double(), approx.effects[kind].flatten().double()
    ok = ~(torch.isnan(a) | torch.isnan(b))
    an, bn = a[ok].numpy(), b[ok].numpy()
    top_a = {(l, h) for l, h, _ in exact.top(k, kind)}
    top_b = {(l, h) for l, h, _ in approx.top(k, kind)}
    out = {"kind": kind, "n": int(ok.sum()), "spearman": None, "pearson": None, f"top{k}_overlap": len(top_a & top_b)}
    if len(an) > 2 and np.std(an) > 0 and np.std(bn) > 0:
        out["spearman"] = float(spearmanr(an, bn).statistic)
        out["pearson"] = float(pearsonr(an, bn).statistic)
        out["spearman_abs"] = float(spearmanr(np.abs(an), np.abs(bn)).statistic)
    if exact.seconds and approx.seconds:
        out["time_ratio"] = exact.seconds / approx.seconds  # how many times faster the approximation ran
    return out
