"""PNGs for explanations and the study (matplotlib's Agg canvas directly: no pyplot, no display).

- :func:`explanation_png`: one row per method, one cell per token, shaded by the score normalised
  per method (signed methods on a diverging scale), special tokens hatched out;
- :func:`study_figures`: ``tau_hist.png`` (Kendall tau of attention with each method),
  ``permutation.png`` (median TVD under permutation against the largest attention weight) and
  ``adversarial.png`` (largest JSD within the TVD budget).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DPI = 110


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def normalised(scores: list[float], keep: list[bool]) -> np.ndarray:
    """Scores divided by the largest magnitude among kept tokens (so in [-1, 1]); 0 where not kept."""
    a = np.asarray(scores, dtype=float)
    k = np.asarray(keep, dtype=bool)
    m = np.abs(a[k]).max() if k.any() else 0.0
    out = a / m if m > 0 else np.zeros_like(a)
    out[~k] = 0.0
    return out


def explanation_png(ex, path: str | Path) -> Path:
    """Tokens x methods heatmap of one :class:`~headlab.interpret.saliency.explanation.Explanation`."""
    methods = ex.methods
    keep = ex.keep()
    grid = np.stack([normalised(ex.scores[m], keep) for m in methods])  # (M, L)
    L = len(ex.tokens)
    fig = _figure(min(max(6.0, 2 + 0.45 * L), 30), 1.2 + 0.5 * len(methods))
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(grid, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
    for j, s in enumerate(ex.special):
        if s:
            ax.axvspan(j - 0.5, j + 0.5, color="0.85", hatch="//", lw=0)
    ax.set_xticks(range(L), ex.tokens, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(methods)), methods, fontsize=8)
    what = f"class {ex.target_label or ex.target}" if ex.kind == "classifier" else ex.kind
    ax.set_title(f"{what}; rows scaled to max |score|", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)


def study_figures(records: list[dict], tables: dict, out: Path) -> list[str]:
    """Write the study's three PNGs into ``out``; returns their names."""
    names = []
    kt = tables.get("kendall") or {}
    if kt:
        fig = _figure(7, 3.5)
        ax = fig.add_subplot(1, 1, 1)
        bins = np.linspace(-1, 1, 41)
        for m in kt:
            taus = [r["tau"].get(f"attention|{m}", [None])[0] for r in records]
            taus = [t for t in taus if t is not None]
            if taus:
                ax.hist(taus, bins=bins, histtype="step", lw=1.5, label=f"{m} (mean {np.mean(taus):.2f})")
        ax.set_xlabel("Kendall tau of attention with the method, per instance")
        ax.set_ylabel("instances")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "tau_hist.png")
        names.append("tau_hist.png")
    perm = [
        (r["permutation"]["max_attention"], r["permutation"]["median_tvd"], r["pred"])
        for r in records
        if r.get("permutation")
    ]
    if perm:
        fig = _figure(5, 3.5)
        ax = fig.add_subplot(1, 1, 1)
        a = np.asarray(perm, dtype=float)
        for c in sorted(set(a[:, 2])):
            sel = a[:, 2] == c
            ax.scatter(a[sel, 0], a[sel, 1], s=8, alpha=0.6, label=f"predicted {int(c)}")
        ax.set_xlabel("max attention (last layer, mean over heads)")
        ax.set_ylabel("median output TVD, 100 permutations")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "permutation.png")
        names.append("permutation.png")
    adv = [r["adversarial"]["max_jsd"] for r in records if r.get("adversarial")]
    if adv:
        fig = _figure(5, 3.5)
        ax = fig.add_subplot(1, 1, 1)
        ax.hist([x for x in adv if x is not None], bins=np.linspace(0, np.log(2), 30))
        ax.set_xlabel(f"max JSD to the original attention with output TVD <= {tables['adversarial']['tvd_budget']}")
        ax.set_ylabel("instances")
        fig.tight_layout()
        fig.savefig(out / "adversarial.png")
        names.append("adversarial.png")
    return names
