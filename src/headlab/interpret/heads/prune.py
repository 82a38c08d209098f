"""Pruning heads: the curve (metric against the share of heads removed) and physical removal.

:func:`pruning_curve` follows Michel et al. 2019: rank every head of every layer globally by
ascending importance (normalised per layer by default, as they do), remove 0%, 10%, ..., 90% of
them (gates at 0: the same model the physical pruning gives, to 1e-5) and measure the metric at
each step: accuracy for a classifier with labels, perplexity for a decoder, else the loss. With
``recompute=True`` importance is computed again, on the pruned model, before each step.
"X% of heads are prunable within 1 point" is the largest step before the metric first leaves
``within`` points of the unpruned one (:func:`bound`: accuracy in percentage points, perplexity in
its own units, the cosine distance in points of cosine similarity, other losses in percent).

:func:`prune_heads` (from :mod:`headlab.models.pruned`) removes heads physically; measured
savings are in :mod:`headlab.interpret.heads.savings`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from headlab.errors import ConfigError
from headlab.interpret.heads import examples as C
from headlab.interpret.heads.importance import importance_scores
from headlab.models.loader import resolve
from headlab.models.pruned import PrunedModel, prune_heads
from headlab.progress import Progress, reporter
from headlab.results import envelope

__all__ = ["PrunedModel", "PruningCurve", "evaluate", "order_heads", "prune_heads", "pruning_curve"]


def evaluate(adapter, data: list[C.Batch], loss: str, *, backend: str = "auto") -> dict:
    """``{"loss", "accuracy" or None, "perplexity" or None}`` of the model as it is gated now."""
    tot_loss = tot_acc = 0.0
    n = 0
    nll_sum = tok = 0.0
    has_acc = True
    with torch.no_grad(), adapter.use_backend(backend):
        for b in data:
            out = adapter.forward(b.inputs)
            ref = {}
            if loss in ("kl", "cosine"):
                ref = b.ref  # type: ignore[attr-defined]  # set by pruning_curve from the unpruned model
            per = C.per_example(loss, out, b, ref)
            tot_loss += float(per.sum())
            n += b.size
            acc = C.accuracy(out, b)
            if acc is None:
                has_acc = False
            else:
                tot_acc += float(acc.sum())
            if loss == "lm":
                assert b.mask is not None  # text: the tokenizer gave an attention mask
                m = (b.mask[:, 1:] & b.mask[:, :-1]).sum(-1).double()
                nll_sum += float((per.double() * m).sum())
                tok += float(m.sum())
    return {
        "loss": tot_loss / n,
        "accuracy": tot_acc / n if has_acc else None,
        "perplexity": math.exp(nll_sum / tok) if loss == "lm" and tok else None,
    }


def order_heads(importance: torch.Tensor) -> list[tuple[int, int]]:
    """Every (layer, head) by ascending importance (NaN = absent heads skipped; ties by position)."""
    flat = [
        (float(importance[l, h]), l, h)
        for l in range(importance.shape[0])
        for h in range(importance.shape[1])
        if not math.isnan(float(importance[l, h]))
    ]
    flat.sort()
    return [(l, h) for _, l, h in flat]


@dataclass
class PruningCurve:
    model: str
    metric: str  # accuracy / perplexity / loss
    loss: str
    recompute: bool
    fractions: list[float]  # share of heads removed at each step
    values: list[float]  # the metric at each step
    losses: list[float]
    removed: list[list[tuple[int, int]]]  # heads removed at each step (cumulative)
    within: float
    prunable_share: float  # largest share whose metric stays within `within` points
    higher_is_better: bool
    notes: list[str] = field(default_factory=list)

    def _repr_html_(self) -> str:
        """This result's page inline in a notebook (headlab's shell in a sandboxed frame; no network)."""
        from headlab.interpret import shell
        from headlab.interpret.heads.page import render_page

        return shell.inline(render_page(title=f"heads: {self.model}", curve=self))

    @classmethod
    def from_json(cls, d: dict) -> PruningCurve:
        return cls(
            d["model"],
            d["metric"],
            d["loss"],
            d["recompute"],
            d["fractions"],
            d["values"],
            d["losses"],
            [[tuple(h) for h in r] for r in d["removed"]],
            d["within"],
            prunable_share(d["metric"], d["loss"], d["fractions"], d["values"], d["within"]),
            d["higher_is_better"],
            d.get("notes", []),
        )

    def share_within(self, within: float) -> float:
        """The prunable share at another tolerance (same units as ``within``)."""
        return prunable_share(self.metric, self.loss, self.fractions, self.values, within)

    def summary(self) -> str:
        return (
            f"{100 * self.prunable_share:.0f}% of heads prunable within {self.within:g} "
            f"{'point' if self.within == 1 else 'points'} of the unpruned "
            f"{'cosine distance' if self.loss == 'cosine' else self.metric} "
            f"({_fmt(self.metric, self.values[0])})"
        )

    def to_json(self) -> dict:
        settings = {"metric": self.metric, "loss": self.loss, "recompute": self.recompute, "within": self.within}
        return envelope(
            "pruning_curve",
            {
                "kind_of_result": "pruning_curve",
                "model": self.model,
                "metric": self.metric,
                "loss": self.loss,
                "recompute": self.recompute,
                "fractions": self.fractions,
                "values": self.values,
                "losses": self.losses,
                "removed": [[list(h) for h in r] for r in self.removed],
                "within": self.within,
                "prunable_share": self.prunable_share,
                "summary": self.summary(),
                "higher_is_better": self.higher_is_better,
                "notes": self.notes,
                "prunable_share_within": {str(w): self.share_within(w) for w in (1, 2, 5, 10)},
            },
            model=self.model,
            settings=settings,
        )

    def plot(self, path: str | Path) -> Path:
        """A PNG of the metric against the share of heads removed."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=110)
        xs = [100 * f for f in self.fractions]
        ys = [100 * v if self.metric == "accuracy" else v for v in self.values]
        ax.plot(xs, ys, "o-", color="#1f6feb")
        lim = bound(self.metric, self.loss, self.values[0], self.within)
        lim = 100 * lim if self.metric == "accuracy" else lim
        ax.axhline(lim, color="#999", ls="--", lw=1, label=f"within {self.within:g} point(s) of unpruned")
        if self.metric == "perplexity":
            ax.set_yscale("log")
        ax.set_xlabel("heads removed (%), ascending importance" + (" (recomputed)" if self.recompute else ""))
        ax.set_ylabel(self.metric + (" (%)" if self.metric == "accuracy" else ""))
        ax.set_title(f"{self.model}: {self.summary()}", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path)
        plt.close(fig)
        return path


def bound(metric: str, loss: str, base: float, within: float) -> float:
    """The worst metric value still "within ``within`` points" of ``base``.

    accuracy: percentage points; perplexity: its own units; the cosine distance: points of cosine
    similarity (0.01 each); other losses (task, lm, kl): ``within`` percent of the unpruned loss."""
    if metric == "accuracy":
        return base - within / 100
    if metric == "perplexity":
        return base + within
    if loss == "cosine":
        return base + within / 100
    return base + abs(base) * within / 100


def prunable_share(metric: str, loss: str, fractions, values, within: float) -> float:
    """The largest share removed before the metric first leaves the bound."""
    lim = bound(metric, loss, values[0], within)
    share = 0.0
    for f, v in zip(fractions, values):
        if (v >= lim) if metric == "accuracy" else (v <= lim):
            share = f
        else:
            break
    return share


def _fmt(metric: str, v: float) -> str:
    return f"{100 * v:.2f}%" if metric == "accuracy" else f"{v:.4g}"


def pruning_curve(
    loaded,
    texts,
    labels=None,
    *,
    loss: C.Loss = "auto",
    importance: torch.Tensor | None = None,
    normalize: bool = True,
    step: float = 0.1,
    max_fraction: float = 0.9,
    recompute: bool = False,
    within: float = 1.0,
    batch_size: int = 16,
    backend: str = "auto",
    seed: int = 0,
    max_length: int | None = None,
    progress: bool | Progress = False,
    local: bool = False,
) -> PruningCurve:
    """Metric after removing 0, 10, ..., 90% of the heads in ascending importance (see the module docstring).

    ``importance``: an ``(n_layers, H)`` grid to rank by (default: :func:`headlab.head_importance`
    on the same texts with ``loss``, normalised per layer when ``normalize``). ``progress``: a bar (True),
    nothing (False) or ``progress(stage, done, total)`` (:mod:`headlab.progress`). ``local``: importance over
    every example on this process, not split over torchrun's ranks (for a caller that runs the curve on one rank
    of several, as the study runner's ``heads prune`` does)."""
    adapter, ld = resolve(loaded)
    loss = C.choose_loss(adapter, loss, labels)
    C.check_data(texts, labels, loss)
    if not 0 < step <= 1 or not 0 < max_fraction <= 1:
        raise ConfigError(f"step and max_fraction must lie in (0, 1], got {step}, {max_fraction}")
    data = C.batches(ld, adapter, texts, labels, batch_size, max_length=max_length)
    if loss in ("kl", "cosine"):
        with torch.no_grad(), adapter.use_backend(backend):
            for b in data:
                b.ref = C.reference(loss, adapter.forward(b.inputs), b)  # type: ignore[attr-defined]  # read by evaluate
    else:
        for b in data:
            b.ref = {}  # type: ignore[attr-defined]  # as above
    kw: dict[str, Any] = dict(
        loss=loss,
        batch_size=batch_size,
        normalize=normalize,
        backend=backend,
        seed=seed,
        max_length=max_length,
        progress=False,
        local=local,
    )
    if importance is None:  # its own bar when progress is one (a callable is not shared with importance.py)
        importance = importance_scores(loaded, texts, labels, **{**kw, "progress": progress is True})[0]
    order = order_heads(importance)
    total = len(order)
    n_steps = int(round(max_fraction / step))
    fractions = [round(i * step, 6) for i in range(n_steps + 1)]
    saved = adapter.gates.detach().clone()
    values, losses, removed = [], [], []
    gone: list[tuple[int, int]] = []
    metric: str | None = None
    try:
        with reporter(progress) as say:
            say("pruning curve", 0, len(fractions))
            for f in fractions:
                target = int(round(f * total))
                if recompute and gone and target > len(gone):  # rank again, on the model pruned so far
                    imp = importance_scores(loaded, texts, labels, **kw)[0]
                    order = [hd for hd in order_heads(imp) if hd not in set(gone)]
                    gone += order[: target - len(gone)]
                else:
                    gone += [hd for hd in order if hd not in set(gone)][: target - len(gone)]
                for l, h in gone:
                    adapter.gates[l, h] = 0.0
                ev = evaluate(adapter, data, loss, backend=backend)
                if metric is None:
                    metric = (
                        "accuracy" if ev["accuracy"] is not None else ("perplexity" if ev["perplexity"] else "loss")
                    )
                values.append(float(ev[metric]))
                losses.append(float(ev["loss"]))
                removed.append(list(gone))
                say("pruning curve", len(values), len(fractions))
    finally:
        adapter.gates = saved
    assert metric is not None  # set at the first fraction (fractions is not empty)
    higher = metric == "accuracy"
    share = prunable_share(metric, loss, fractions, values, within)
    name = ld.name if ld is not None else type(adapter.model).__name__
    notes = [
        f"ranked by {'normalised ' if normalize else ''}importance (loss={loss}); heads removed by gates, "
        "which equal physical removal to 1e-5"
    ]
    return PruningCurve(name, metric, loss, recompute, fractions, values, losses, removed, within, share, higher, notes)
