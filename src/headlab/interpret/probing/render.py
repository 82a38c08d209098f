"""Pictures and the page of a probe: a heads x relations heatmap, the head map, one HTML page.

Matplotlib's Agg canvas, used directly (no pyplot), as the analyze report does. The page is self
contained: its style sheet and both pictures (base64 PNG) are inline, nothing is fetched.

    >>> import numpy as np, tempfile, os
    >>> from headlab.interpret.probing.probe_result import MEASURES, ProbeResult
    >>> r = ProbeResult("m", "bert", False, "t.conllu", 1, 2, 1, 5, ["det"], np.full((2, 1, 2, 1), 0.5),
    ...                 np.ones((2, 1)), np.ones((2, 1)), np.full((2, 1), 0.25), np.ones((2, 1), dtype=int),
    ...                 {k: np.zeros((1, 2)) for k in MEASURES}, head_map=np.zeros((2, 2)))
    >>> d = tempfile.mkdtemp()
    >>> paths = write_outputs(r, d)
    >>> sorted(p.name for p in paths)
    ['head_map.png', 'probe.html', 'relations.csv', 'relations.json', 'relations_heatmap.png']
"""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path
from typing import Any

import numpy as np

from headlab.interpret import shell
from headlab.interpret.probing.gold import DIRECTIONS
from headlab.outputs import check_output_dir

# a ProbeResult: probe_result imports this module (for its page), so the class is named, not imported, here
_ProbeResult = Any

OUTPUT_FILES = ("relations.csv", "relations.json", "relations_heatmap.png", "head_map.png", "probe.html")
MAX_HEATMAP_RELATIONS = 30  # the most frequent relations drawn in the heatmap
DPI = 110

# Clark et al. (2019), Table 1: BERT-base on the WSJ Penn Treebank with Stanford Dependencies; the UD
# relation that corresponds, the SD name, their best head, its accuracy and the best offset baseline (%).
CLARK_TABLE1 = {
    "case": ("prep", "7-4", 66.7, 61.8),
    "det": ("det", "8-11", 94.3, 51.7),
    "compound": ("nn", "4-10", 70.4, 70.2),
    "nsubj": ("nsubj", "8-2", 58.5, 45.5),
    "amod": ("amod", "4-10", 75.6, 68.3),
    "obj": ("dobj", "8-10", 86.8, 40.0),
    "advmod": ("advmod", "7-6", 48.8, 40.2),
    "aux": ("aux", "4-10", 81.1, 71.5),
    "nmod:poss": ("poss", "7-6", 80.5, 47.7),
    "aux:pass": ("auxpass", "4-10", 82.5, 40.5),
    "ccomp": ("ccomp", "8-1", 48.8, 12.4),
    "mark": ("mark", "8-2", 50.7, 14.5),
    "compound:prt": ("prt", "6-7", 99.1, 91.4),
}


def prepare_out_dir(out_dir: str | os.PathLike, *, force: bool = False, option: str = "--out") -> Path:
    """Check before any work that ``out_dir`` can take the probe's files (new, empty, or ``force``: the one
    check, :func:`headlab.outputs.check_output_dir`), then make it."""
    path = check_output_dir(out_dir, option, force=force)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def heatmap_png(r: _ProbeResult, path: str | os.PathLike) -> Path:
    """Accuracy of every head (columns, layer by layer) on the most frequent relations (rows), one
    panel per direction; a dot marks each relation's best head, ``*`` a relation whose best head
    beats its baseline."""
    R = min(len(r.relation_names), MAX_HEATMAP_RELATIONS)
    K = r.n_layers * r.n_heads
    fig = _figure(min(22.0, 3.0 + 0.06 * K + 2), 1.6 + 0.26 * R * 2)
    axes = fig.subplots(2, 1, squeeze=False)[:, 0]
    for d, ax in enumerate(axes):
        acc = r.accuracy[d, :, :, :R].reshape(K, R).T  # (R, K)
        im = ax.imshow(acc, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
        best = np.nanargmax(acc, axis=1)  # NaN: a head a pruned layer lacks
        ax.scatter(best, np.arange(R), s=9, c="red", marker="o")
        labels = [
            f"{name}{' *' if acc[i, best[i]] > r.baseline_accuracy[d, i] else ''} ({int(r.count[d, i])})"
            for i, name in enumerate(r.relation_names[:R])
        ]
        ax.set_yticks(np.arange(R), labels, fontsize=7)
        ticks = np.arange(0, K, r.n_heads)
        ax.set_xticks(ticks, [f"L{i}" for i in range(r.n_layers)], fontsize=7)
        for x in ticks[1:]:
            ax.axvline(x - 0.5, color="white", lw=0.6)
        seen = " (a causal model sees it when the answer comes first)" if r.causal else ""
        ax.set_title(
            f"{DIRECTIONS[d]}: accuracy of each head{seen}; red dot = best head, * = beats the offset baseline",
            fontsize=9,
        )
    fig.colorbar(im, ax=list(axes), fraction=0.02, pad=0.01, label="accuracy")
    fig.suptitle(f"{r.model}: heads x relations on {Path(r.treebank).name} ({r.sentences} sentences)", fontsize=11)
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    return path


def head_map_png(r: _ProbeResult, path: str | os.PathLike) -> Path:
    """The heads embedded in 2-D by classical MDS of their Jensen-Shannon distances, coloured by layer
    (Clark et al. 2019, figure 6)."""
    fig = _figure(6.5, 5.5)
    ax = fig.subplots()
    if r.head_map is None:
        ax.text(0.5, 0.5, "no head map (head_map_sentences=0)", ha="center", va="center")
        ax.axis("off")
    else:
        layers = np.repeat(np.arange(r.n_layers), r.n_heads)
        sc = ax.scatter(
            r.head_map[:, 0], r.head_map[:, 1], c=layers, cmap="viridis", s=22, edgecolors="k", linewidths=0.3
        )
        fig.colorbar(sc, ax=ax, label="layer")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(
            f"{r.model}: heads by Jensen-Shannon distance of their attention\n(classical MDS, "
            f"{r.head_map_sentences} sentences), coloured by layer",
            fontsize=10,
        )
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    return path


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}"


def render_html(r: _ProbeResult, heatmap: Path, head_map: Path) -> str:
    """The page: summary, best head per relation and direction, the two pictures, the per-layer table,
    the skipped sentences."""
    e = html.escape
    rows = []
    for b in r.best_heads:
        win = b.count >= r.min_count and b.margin > 0
        clark = CLARK_TABLE1.get(b.relation) if b.direction == "dep->head" else None
        rows.append(
            f'<tr><td class="text">{e(b.relation)}</td><td class="text">{e(b.direction)}</td>'
            f"<td>{b.layer}-{b.head}</td><td{' class=win' if win else ''}>{_pct(b.accuracy)}</td>"
            f"<td>{b.baseline_offset:+d}</td><td>{_pct(b.baseline_accuracy)}</td><td>{100 * b.margin:+.1f}</td>"
            f"<td>{b.count}</td>"
            + (f"<td>{_pct(b.visible)}</td>" if r.causal else "")
            + (
                f'<td class="text">{e(clark[0])} {clark[1]}: {clark[2]} vs {clark[3]}</td>'
                if clark
                else '<td class="text"></td>'
            )
            + "</tr>"
        )
    vis_head = "<th>visible %</th>" if r.causal else ""
    best = (
        '<table class="stats"><thead><tr><th class="text">relation</th><th class="text">direction</th>'
        f"<th>best head</th><th>accuracy %</th><th>offset</th><th>baseline %</th><th>margin</th><th>count</th>"
        f'{vis_head}<th class="text">Clark et al. BERT-base (Table 1)</th></tr></thead><tbody>'
        + "".join(rows)
        + "</tbody></table>"
    )
    first = "first token" if r.causal else "[CLS]"
    heads_ = [
        "layer",
        first,
        "[SEP]",
        "punct",
        "next",
        "prev",
        "self",
        "entropy",
        "|grad| [SEP]",
        "|grad| other",
        f"|grad| {first}",
    ]
    if r.causal:
        heads_[8] = "|grad| first"
    layer_rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{v}</td>"
            for v in (
                x.layer,
                _pct(x.to_first),
                _pct(x.to_sep),
                _pct(x.to_punct),
                _pct(x.to_next),
                _pct(x.to_prev),
                _pct(x.to_self),
                f"{x.entropy:.2f}",
                "" if x.grad_sep is None else f"{x.grad_sep:.2e}",
                "" if x.grad_other is None else f"{x.grad_other:.2e}",
                "" if x.grad_first is None else f"{x.grad_first:.2e}",
            )
        )
        + "</tr>"
        for x in r.per_layer
    )
    layers = (
        '<table class="stats"><thead><tr>'
        + "".join(f"<th>{e(h)}</th>" for h in heads_)
        + f"</tr></thead><tbody>{layer_rows}</tbody></table>"
    )
    skipped = "".join(f"<li>{e(s.sent_id)}: {e(s.reason)}</li>" for s in r.skipped[:200])
    more = f"<li>... {len(r.skipped) - 200} more (relations.json lists all)</li>" if len(r.skipped) > 200 else ""
    summary = (
        f"{r.model} ({r.family}, {r.n_layers} layers x {r.n_heads} heads{', causal' if r.causal else ''}) on "
        f"{Path(r.treebank).name}: {r.sentences} sentences, {r.tokens} tokens, {len(r.skipped)} skipped, "
        f"{r.seconds:.0f} s."
    )
    body = f"""<section><h2>Best head per relation</h2>
<p class="hint">A head predicts, for each word, the other word it attends to most (subword attention merged
as Clark et al. 2019 do: summed over the attended word's tokens, averaged over the attending word's; special
tokens and the word itself ignored). dep->head: right when that word is the gold head; head->dep: right when it
is a dependent with that relation. Baseline: the best fixed offset on the same sentences. Green: beats it
with at least {r.min_count} cases.{' Visible: the share of cases whose answer lies before the asking word, all a causal model can get.' if r.causal else ''}
Clark et al.'s figures are BERT-base on the Penn Treebank with Stanford Dependencies (their relation named first).</p>
{best}</section>
<section><h2>Heads x relations</h2>{_img(heatmap)}</section>
<section><h2>Per layer (Clark et al. 2019, section 3)</h2>
<p class="hint">Mean attention in % of a token's attention (over every token of every sentence), averaged over the
heads of the layer; entropy in nats. Gradient: {e(r.grad_note)}.</p>{layers}</section>
<section><h2>Head map (Clark et al. 2019, figure 6)</h2>{_img(head_map)}</section>
<section><h2>Skipped sentences ({len(r.skipped)})</h2><ul>{skipped}{more}</ul></section>
"""
    return shell.page(
        title=f"headlab probe: {r.model}",
        body=body,
        summary_lines=[summary],
        banner=" ".join(r.notes) or None,
        generator="headlab probe",
    )


def write_outputs(r: _ProbeResult, out_dir: str | os.PathLike) -> list[Path]:
    """Write :data:`OUTPUT_FILES` into ``out_dir`` (which must exist) and return their paths."""
    out = Path(out_dir)
    csv_path = r.to_csv(out / "relations.csv")
    json_path = r.save_json(out / "relations.json")
    heat = heatmap_png(r, out / "relations_heatmap.png")
    hmap = head_map_png(r, out / "head_map.png")
    page = out / "probe.html"
    page.write_text(render_html(r, heat, hmap), encoding="utf-8")
    return [csv_path, json_path, heat, hmap, page]


__all__ = [
    "CLARK_TABLE1",
    "OUTPUT_FILES",
    "head_map_png",
    "heatmap_png",
    "prepare_out_dir",
    "render_html",
    "write_outputs",
]
