"""The flow results' page (norm maps, rollout, attention flow), in headlab's shell: what a notebook shows inline.

Each map is drawn once with matplotlib (rows are query tokens, columns key tokens; each row scaled to
its largest value so a row's shape reads at any length) and embedded as a PNG; token rows (rollout
rows, a flow vector) are shaded strips, as the report draws them. No network.
"""

from __future__ import annotations

import base64
import html
import io

import numpy as np

from headlab.interpret import shell

MAX_MAPS = 12  # maps drawn on one page (the rest are named in a note)


def _png(maps: list[tuple[str, np.ndarray]], tokens: list[str] | None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(maps))
    rows = -(-len(maps) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (title, m) in zip(axes.flat, maps):
        m = np.asarray(m, dtype=np.float64)
        peak = np.maximum(m.max(-1, keepdims=True), 1e-30)
        ax.imshow(m / peak, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.axis("on")
        if tokens is not None and len(tokens) <= 40:
            ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=6)
            ax.set_yticks(range(len(tokens)), tokens, fontsize=6)
        else:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return f'<img alt="maps" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode("ascii")}">'


def _strip(label: str, values, tokens: list[str] | None) -> str:
    v = np.asarray(values, dtype=np.float64)
    peak = max(float(v.max()), 1e-30) if v.size else 1.0
    toks = tokens if tokens is not None else [str(i) for i in range(v.size)]
    spans = "".join(
        f'<span class="tok" title="{html.escape(t)}: {x:.4g}" style="background: rgba(47, 158, 68, '
        f'{max(0.0, x / peak):.3f})">{html.escape(t)}</span>'
        for t, x in zip(toks, v)
    )
    return f'<p class="strip-title">{html.escape(label)}</p><div class="strip">{spans}</div>'


def flow_page(result) -> str:
    """The page of a :class:`~headlab.interpret.flow.norms.NormsResult`, a
    :class:`~headlab.interpret.flow.rollout.RolloutResult` or a :class:`~headlab.interpret.flow.maxflow.FlowResult`."""
    tokens, body, lines = getattr(result, "tokens", None), [], []
    kind = type(result).__name__
    if kind == "NormsResult":
        title = f"norm maps ({result.mode} mode), layers {', '.join(map(str, result.layers))}"
        maps = [(f"layer {l}: ||sum_h alpha f_h(x)||", result.layer[l]) for l in sorted(result.layer)]
        if maps:
            body.append(f"<section><h2>Layer norm maps</h2>{_png(maps[:MAX_MAPS], tokens)}</section>")
        for l in sorted(result.row_layer):
            rows = result.row_layer[l]
            body.append(
                f"<section><h2>Layer {l}: chosen rows</h2>"
                + "".join(_strip(f"row {p}", rows[i], tokens) for i, p in enumerate(result.rows or []))
                + "</section>"
            )
        if result.summaries:
            lines.append(
                f"streaming summaries of layers {', '.join(map(str, sorted(result.summaries)))} (see .to_json())"
            )
        lines.append("Kobayashi et al. 2020 (attention mode) / 2021 (residual mode); each row scaled to its maximum")
    elif kind == "RolloutResult":
        title = f"attention rollout ({result.method}), through layer {result.layer}"
        if result.maps is not None:
            body.append(
                f"<section><h2>Rollout through the last layer</h2>"
                f"{_png([(f'layer {result.layer}', result.maps[-1])], tokens)}</section>"
            )
        if result.rows is not None:
            body.append(
                "<section><h2>Rows</h2>"
                + "".join(_strip(f"token {p}", result.rows[i], tokens) for i, p in enumerate(result.row_positions))
                + "</section>"
            )
        lines.append("Abnar and Zuidema 2020: per layer 0.5 A + 0.5 I, multiplied from the first layer up")
    elif kind == "FlowResult":
        title = f"attention flow from token {result.source} at layer {result.layer}"
        body.append(f"<section><h2>Flow to each input token</h2>{_strip('flow', result.flow, tokens)}</section>")
        lines.append(f"Abnar and Zuidema 2020, max-flow ({result.solver}; certificate gap {result.gap:.2g})")
    else:
        raise TypeError(f"no flow page for {kind}")
    return shell.page(
        title=title, body="".join(body) or "<p>nothing to draw</p>", summary_lines=lines, generator="headlab flow"
    )


__all__ = ["flow_page"]
