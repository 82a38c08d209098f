"""The circuit page's faithfulness curve (:mod:`headlab.interpret.circuits.page` puts it on the page).

f against the fraction of the graph's edges kept (log x): the top-k circuits' curve over the band of the random
circuits of the same sizes (mean -+ one sd), the page's circuit itself as a diamond, with CPR and CMD.
:func:`curve_points` reads the numbers from a :class:`~headlab.interpret.circuits.Faithfulness` (or its
result's JSON dict); :func:`faithfulness_section` draws them under their heading and notes.
"""

from __future__ import annotations

import html
import math

from headlab.interpret.circuits.page_circuit import SIGN_COLOURS, as_number

__all__ = ["curve_points", "faithfulness_section"]


def _get(obj, *names, default=None):
    """An attribute of a result, or a key of its JSON dict (figures at the top, settings under the header)."""
    for n in names:
        if isinstance(obj, dict):
            v = obj.get(n, ((obj.get("headlab") or {}).get("settings") or {}).get(n))
        else:
            v = getattr(obj, n, None)
        if v is not None:
            return v
    return default


def _listed(v) -> list:
    if v is None:
        return []
    if hasattr(v, "tolist"):
        v = v.tolist()
    return list(v)


def curve_points(faith, n_graph_edges: int | None = None) -> dict:
    """The numbers the curve draws, from a :class:`~headlab.interpret.circuits.Faithfulness` (or its
    ``to_result().to_json()`` dict), one entry per circuit size: ``fractions``, ``sizes``, ``kept``, ``f``, and the
    random circuits' band ``random_lo``, ``random_mean``, ``random_hi`` (mean -+ one sample sd); ``cpr``, ``cmd``.

    >>> pts = curve_points({"sizes": [1, 10], "fractions": [0.1, 1.0], "f": [0.4, 1.0], "random_mean": [0.1, 1.0],
    ...                     "random_sd": [0.05, 0.0], "cpr": 0.63, "cmd": 0.27})
    >>> pts["random_lo"], pts["random_hi"], pts["cpr"]
    ([0.05, 1.0], [0.15000000000000002, 1.0], 0.63)
    """
    n_total = _get(faith, "n_graph_edges", default=n_graph_edges)
    sizes = [int(s) for s in _listed(_get(faith, "sizes"))]
    fractions = [float(x) for x in _listed(_get(faith, "fractions"))]
    if not fractions and sizes and n_total:
        fractions = [s / float(n_total) for s in sizes]
    mean = [as_number(x) for x in _listed(_get(faith, "random_mean"))]
    sd = [as_number(x) for x in _listed(_get(faith, "random_sd"))] or [None] * len(mean)
    lo = [None if m is None else m - (d or 0.0) for m, d in zip(mean, sd)]
    hi = [None if m is None else m + (d or 0.0) for m, d in zip(mean, sd)]
    return {
        "fractions": fractions,
        "sizes": sizes,
        "kept": [int(k) for k in _listed(_get(faith, "kept"))],
        "f": [as_number(x) for x in _listed(_get(faith, "f"))],
        "random_lo": lo,
        "random_mean": mean,
        "random_hi": hi,
        "cpr": as_number(_get(faith, "cpr")),
        "cmd": as_number(_get(faith, "cmd")),
        "source": _get(faith, "source", default=""),
    }


def _svg_curve(pts: dict, own: tuple[float, float] | None = None) -> str:
    """The curve (``own``: the page's circuit as one more point, ``(fraction, f)``, drawn as a diamond)."""
    xs = [x for x in pts["fractions"] + ([own[0]] if own else []) if x and x > 0]
    if not xs:
        return "<p class='note'>no circuit sizes to draw</p>"
    w, h, ml, mr, mt, mb = 560, 300, 52, 16, 14, 42
    ys = (
        [v for k in ("f", "random_lo", "random_hi") for v in pts[k] if v is not None]
        + [0.0, 1.0]
        + ([own[1]] if own else [])
    )
    y0, y1 = min(ys), max(ys)
    y0, y1 = y0 - 0.05 * (y1 - y0), y1 + 0.05 * (y1 - y0)
    lx0, lx1 = math.floor(math.log10(min(xs))), max(0, math.ceil(math.log10(max(xs))))
    if lx1 == lx0:
        lx0 -= 1

    def X(frac: float) -> float:
        return ml + (math.log10(frac) - lx0) / (lx1 - lx0) * (w - ml - mr)

    def Y(v: float) -> float:
        return mt + (y1 - v) / (y1 - y0) * (h - mt - mb)

    out = [
        f'<svg class="faithfulness" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
        'aria-label="faithfulness against the fraction of edges">',
        f'<rect x="{ml}" y="{mt}" width="{w - ml - mr}" height="{h - mt - mb}" fill="#fff" stroke="#c8cdd8"/>',
    ]
    for k in range(lx0, lx1 + 1):
        x = X(10.0**k)
        label = f"{100 * 10.0**k:g}%"
        out.append(
            f'<line x1="{x:.1f}" y1="{mt}" x2="{x:.1f}" y2="{h - mb}" stroke="#eef0f4"/>'
            f'<text x="{x:.1f}" y="{h - mb + 14}" text-anchor="middle" font-size="10">{label}</text>'
        )
    step = next(s for s in (0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 50, 100, math.inf) if (y1 - y0) / s <= 8)
    ticks = [i * step for i in range(math.ceil(y0 / step), math.floor(y1 / step) + 1)] if math.isfinite(step) else []
    for v in ticks:
        out.append(
            f'<line class="grid" x1="{ml}" y1="{Y(v):.1f}" x2="{w - mr}" y2="{Y(v):.1f}" stroke="#eef0f4"/>'
            f'<text x="{ml - 6}" y="{Y(v) + 4:.1f}" text-anchor="end" font-size="10">{v:g}</text>'
        )
    for v in (0.0, 1.0):  # f = 0 (every edge ablated) and f = 1 (the model)
        out.append(
            f'<line class="ref" x1="{ml}" y1="{Y(v):.1f}" x2="{w - mr}" y2="{Y(v):.1f}" stroke="#868e96" '
            'stroke-dasharray="4 3"/>'
        )
    out.append(
        f'<text x="{(ml + w - mr) / 2:.0f}" y="{h - 6}" text-anchor="middle" font-size="11">fraction of the '
        f"graph's edges in the circuit (log)</text>"
        f'<text x="12" y="{(mt + h - mb) / 2:.0f}" font-size="11" text-anchor="middle" '
        f'transform="rotate(-90 12 {(mt + h - mb) / 2:.0f})">faithfulness f</text>'
    )
    band = [
        (X(x), Y(a), Y(b))
        for x, a, b in zip(pts["fractions"], pts["random_lo"], pts["random_hi"])
        if x and x > 0 and a is not None and b is not None
    ]
    if band:
        poly = (
            " ".join(f"{x:.1f},{b:.1f}" for x, _, b in band)
            + " "
            + " ".join(f"{x:.1f},{a:.1f}" for x, a, _ in reversed(band))
        )
        out.append(
            f'<polygon class="random-band" points="{poly}" fill="#adb5bd" fill-opacity="0.35" stroke="none">'
            "<title>random circuits of the same sizes: mean -+ one standard deviation</title></polygon>"
        )
        mean = [(X(x), Y(m)) for x, m in zip(pts["fractions"], pts["random_mean"]) if x and x > 0 and m is not None]
        out.append(
            '<polyline class="random-mean" points="'
            + " ".join(f"{x:.1f},{y:.1f}" for x, y in mean)
            + '" fill="none" stroke="#868e96" stroke-dasharray="5 3"/>'
        )
    n = len(pts["fractions"])
    sizes, kept = pts["sizes"] or [None] * n, pts["kept"] or [None] * n
    line = [
        (X(x), Y(v), x, v, s, k)
        for x, v, s, k in zip(pts["fractions"], pts["f"], sizes, kept)
        if x and x > 0 and v is not None
    ]
    if line:
        out.append(
            '<polyline class="curve" points="'
            + " ".join(f"{x:.1f},{y:.1f}" for x, y, *_ in line)
            + f'" fill="none" stroke="{SIGN_COLOURS[1]}" stroke-width="2"/>'
        )
        for x, y, frac, v, s, k in line:
            size = "" if s is None else f"top {s} edges" + ("" if k is None else f" ({k} after pruning)") + ", "
            out.append(
                f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{SIGN_COLOURS[1]}">'
                f"<title>{size}{100 * frac:.3g}% of the edges: f = {v:.4g}</title></circle>"
            )
    if own and own[0] > 0:
        x, y = X(own[0]), Y(own[1])
        out.append(
            f'<path class="own" d="M{x:.1f},{y - 7:.1f} L{x + 7:.1f},{y:.1f} L{x:.1f},{y + 7:.1f} '
            f'L{x - 7:.1f},{y:.1f} Z" fill="{SIGN_COLOURS[-1]}" stroke="#fff"><title>this circuit: '
            f"{100 * own[0]:.3g}% of the edges, f = {own[1]:.4g}</title></path>"
        )
    out.append("</svg>")
    return "".join(out)


def faithfulness_section(faith, circuit, n_graph_edges) -> tuple[str, dict]:
    """The page's "Faithfulness" section (the curve, CPR and CMD, how to read it) and the curve's numbers
    (:func:`curve_points`), which the page carries in its data for its selftest."""
    pts = curve_points(faith, n_graph_edges)
    own_f, n_graph = as_number(getattr(circuit, "faithfulness", None)), getattr(circuit, "n_graph_edges", None)
    own = (len(circuit.edges) / n_graph, own_f) if own_f is not None and n_graph else None
    stats = []
    if pts["cpr"] is not None:
        stats.append(f"CPR {pts['cpr']:.4g} (area under f: higher is better)")
    if pts["cmd"] is not None:
        stats.append(f"CMD {pts['cmd']:.4g} (area between f and 1: lower is better)")
    note = (
        "f = (m(circuit) - m(empty)) / (m(model) - m(empty)): 1 is the whole model's behaviour, 0 that of a "
        "circuit with no edge (everything ablated); blue: the top-k edges by the scores"
        + (f" ({pts['source']})" if pts["source"] else "")
        + " at each size, pruned to the edges on a path; grey: "
        "random circuits of the same sizes (dashed: their mean, band: one standard deviation)"
        + ("; orange diamond: this circuit" if own else "")
    )
    return (
        f"<h2>Faithfulness</h2>{_svg_curve(pts, own)}<div class='note'>{html.escape('; '.join(stats))}</div>"
        f"<div class='note'>{html.escape(note)}</div>",
        pts,
    )
