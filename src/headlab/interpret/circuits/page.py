"""The circuit page: one self-contained file in headlab's shell (:mod:`headlab.interpret.shell`; no network).

- **the circuit** as SVG: layers up the page (the input at the bottom, the logits at the top), a layer's heads side
  by side with its MLP beside them and half a row higher (a sequential MLP reads its own layer's heads, so every
  edge runs upwards); one ``<line class="edge">`` per edge, its width and opacity following ``|score|``, its
  colour the score's sign. A head's inputs are three ports on its lower edge, ``q`` left, ``k`` middle, ``v``
  right, and the line's dash says which: ``q`` solid, ``k`` dashed, ``v`` dotted. On a grouped-query model
  (``k``/``v`` are per *kv head*, shared by ``H / Hkv`` query heads) the k and v edges end on a small node of
  their own, ``kv{g}``, joined by a thin grey line to the group's query heads in the circuit;
- the heads' **labels** (the atlas's roles, ``{"a3.h2": "induction"}`` or an
  :class:`~headlab.interpret.atlas.result.Atlas`) written in their nodes;
- the **faithfulness curve** when given: f against the fraction of the graph's edges kept (log x), the circuit's
  curve over the band of the random circuits of the same sizes (mean -+ one sd), the circuit itself as a
  diamond, with CPR and CMD;
- the **top edges**: a table by ``|score|``.

Hovering a node lights its edges; clicking a row of the table lights its edge. Opening the page with
``#selftest`` makes it check itself (one line per edge of the data, a click on the first row selects its line,
the curve's points) and write ``<pre id="selftest-result" data-status="pass|fail">``; script errors are written
too (``<pre class="selftest-error">``), as on headlab's other pages.

    >>> from types import SimpleNamespace as C
    >>> c = C(model="toy", edges=["input->a0.h0<q>", "a0.h0->logits"], method="eap-ig", n_graph_edges=37,
    ...       ablation="patch", scores={"input->a0.h0<q>": 0.5, "a0.h0->logits": -1.0})
    >>> page = render(c, labels={"a0.h0": "previous-token"})
    >>> page.count('<line class="edge"'), "previous-token" in page, "http" in page.split("<body>")[1]
    (2, True, False)
"""

from __future__ import annotations

import html
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from headlab.interpret import shell

__all__ = ["head_labels", "inline", "render", "write"]

# ---- names -------------------------------------------------------------------------------------------------------

_HEAD = re.compile(r"^a(\d+)\.h(\d+)$")
_MLP = re.compile(r"^m(\d+)$")
_RECEIVER = re.compile(r"^a(\d+)\.h(\d+)<([qkv])>$")
SIGN_COLOURS = {1: "#1971c2", -1: "#e8590c", 0: "#868e96"}  # score > 0, < 0, unknown
DASH = {"q": "", "k": "7 4", "v": "2 3"}  # a head's three inputs; MLP and logits edges are solid


def _split(edge: str) -> tuple[str, str]:
    sender, sep, receiver = edge.partition("->")
    if not sep:
        from headlab.errors import InputError

        raise InputError(f"{edge!r} is not an edge name: edges are 'sender->receiver', e.g. 'a0.h1->a3.h2<q>'")
    return sender, receiver


def _layer_of(node: str) -> int | None:
    m = _HEAD.match(node) or _MLP.match(node)
    return int(m.group(1)) if m else None


def _kind(receiver: str) -> str:
    """``"q"``, ``"k"``, ``"v"``, ``"mlp"`` or ``"logits"``."""
    m = _RECEIVER.match(receiver)
    return m.group(3) if m else ("logits" if receiver == "logits" else "mlp")


def head_labels(labels) -> dict[str, str]:
    """``{"a3.h2": "induction, previous-token"}`` from what ``render`` takes as ``labels``:

    a dict keyed ``"a3.h2"``, ``"3.2"`` or ``(3, 2)`` whose values are a text or a list of texts, or an
    :class:`~headlab.interpret.atlas.result.Atlas` (its roles of each head).

    >>> head_labels({"3.2": ["induction", "copying"], (0, 1): "previous-token"})
    {'a3.h2': 'induction, copying', 'a0.h1': 'previous-token'}
    """
    if labels is None:
        return {}
    if callable(getattr(labels, "roles", None)) and hasattr(labels, "n_layers"):  # an Atlas
        labels = {(l, h): labels.roles(l, h) for l in range(labels.n_layers) for h in range(labels.n_heads)}
    if not isinstance(labels, dict):
        from headlab.errors import InputError

        raise InputError(f"labels: give a dict such as {{'a3.h2': 'induction'}} or an atlas result, not "
                         f"{type(labels).__name__}")
    out = {}
    for key, value in labels.items():
        if isinstance(key, tuple) and len(key) == 2:
            key = f"a{int(key[0])}.h{int(key[1])}"
        elif isinstance(key, str) and re.match(r"^\d+\.\d+$", key):
            key = "a{}.h{}".format(*key.split("."))
        text = value if isinstance(value, str) else ", ".join(str(v) for v in (value or []))
        if text:
            out[str(key)] = text
    return out


# ---- the circuit's layout ------------------------------------------------------------------------------------------

W, H_NODE, GAP, ROW, PAD, GUTTER = 58, 34, 14, 86, 24, 44  # node width and height, spacing, layer height, margins


@dataclass
class _Node:
    name: str
    kind: str  # "input", "head", "kv", "mlp", "logits"
    layer: int | None
    index: int = 0
    x: float = 0.0
    y: float = 0.0
    width: float = W
    label: str = ""
    group: list[int] = field(default_factory=list)  # a kv node's query heads (when the model's groups are known)

    @property
    def top(self) -> float:
        return self.y - H_NODE / 2

    @property
    def bottom(self) -> float:
        return self.y + H_NODE / 2


def _groups(circuit, graph) -> tuple[list[int], list[int]] | None:
    """Per layer (query heads, kv heads), from ``graph`` or the circuit itself; None when neither says."""
    for source in (graph, getattr(circuit, "graph", None), circuit):
        heads, kv = getattr(source, "heads", None), getattr(source, "kv_heads", None)
        if isinstance(heads, (list, tuple)) and isinstance(kv, (list, tuple)) and len(heads) == len(kv):
            return [int(h) for h in heads], [int(g) for g in kv]
    return None


def _receiver_node(receiver: str, groups) -> tuple[str, str, int | None, int]:
    """(node name, node kind, layer, index) of the node an edge into ``receiver`` ends on."""
    if receiver == "logits":
        return "logits", "logits", None, 0
    m = _RECEIVER.match(receiver)
    if m is None:
        return receiver, "mlp", _layer_of(receiver), 0
    layer, index, kind = int(m.group(1)), int(m.group(2)), m.group(3)
    if kind == "q":
        return f"a{layer}.h{index}", "head", layer, index
    if groups is not None and layer < len(groups[0]) and groups[0][layer] == groups[1][layer]:
        return f"a{layer}.h{index}", "head", layer, index  # one kv head per query head: the head itself
    return f"a{layer}.kv{index}", "kv", layer, index


def _sender_node(sender: str) -> tuple[str, str, int | None, int]:
    if sender == "input":
        return "input", "input", None, 0
    m = _HEAD.match(sender)
    if m:
        return sender, "head", int(m.group(1)), int(m.group(2))
    return sender, "mlp", _layer_of(sender), 0


def _layout(edges: list[str], groups, labels: dict[str, str]):
    """The nodes (placed) and, per edge, (sender node, receiver node, input kind)."""
    nodes: dict[str, _Node] = {"input": _Node("input", "input", None, width=80),
                               "logits": _Node("logits", "logits", None, width=80)}
    ends = []
    for e in edges:
        s, r = _split(e)
        got = []
        for name, kind, layer, index in (_sender_node(s), _receiver_node(r, groups)):
            if name not in nodes:
                nodes[name] = _Node(name, kind, layer, index, label=labels.get(name, ""))
            got.append(nodes[name])
        ends.append((got[0], got[1], _kind(r)))
    if groups is not None:  # a kv node's query heads: those of its group that the circuit holds
        for n in nodes.values():
            if n.kind == "kv" and n.layer < len(groups[0]) and groups[1][n.layer]:
                per = groups[0][n.layer] // groups[1][n.layer]
                n.group = [h for h in range(n.index * per, (n.index + 1) * per) if f"a{n.layer}.h{h}" in nodes]
    layers = sorted({n.layer for n in nodes.values() if n.layer is not None})
    rows = {l: sorted((n for n in nodes.values() if n.layer == l and n.kind in ("head", "kv")),
                      key=lambda n: (n.kind == "kv", n.index)) for l in layers}
    mlps = {n.layer: n for n in nodes.values() if n.kind == "mlp"}
    widest = max([len(rows[l]) + (l in mlps) for l in layers] + [2])
    width = GUTTER + 2 * PAD + widest * (W + GAP)
    height = 2 * PAD + (len(layers) + 1) * ROW + H_NODE
    centre = GUTTER + (width - GUTTER) / 2

    def y_of(level: int) -> float:  # level 0: the input; 1..len(layers): the layers; then the logits
        return height - PAD - H_NODE / 2 - level * ROW

    nodes["input"].x, nodes["input"].y = centre, y_of(0)
    nodes["logits"].x, nodes["logits"].y = centre, y_of(len(layers) + 1)
    for level, l in enumerate(layers, 1):
        row = rows[l] + ([mlps[l]] if l in mlps else [])
        x0 = centre - (len(row) * (W + GAP) - GAP) / 2 + W / 2
        for i, n in enumerate(row):
            n.x, n.y = x0 + i * (W + GAP), y_of(level) - (ROW / 2 if n.kind == "mlp" else 0)
    return nodes, ends, layers, width, height, y_of


def _port(node: _Node, kind: str) -> float:
    """The x where an edge of input ``kind`` ends on ``node``'s lower edge."""
    if node.kind == "head":
        return node.x + {"q": -16, "k": 0, "v": 16}.get(kind, 0)
    if node.kind == "kv":
        return node.x + {"k": -10, "v": 10}.get(kind, 0)
    return node.x


def _num(v) -> float | None:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def _on_path(circuit) -> set[str] | None:
    """The nodes on a path from the input to the logits (:attr:`Circuit.nodes`), or None when not known."""
    try:
        on = getattr(circuit, "nodes", None)
    except Exception:  # noqa: BLE001  (a circuit whose graph cannot be rebuilt: every node drawn alike)
        return None
    return set(on) if isinstance(on, (list, tuple, set)) else None


def _svg_circuit(circuit, labels: dict[str, str], graph) -> tuple[str, list[dict]]:
    edges = list(circuit.edges)
    scores = getattr(circuit, "scores", None) or {}
    nodes, ends, layers, width, height, y_of = _layout(edges, _groups(circuit, graph), labels)
    on = _on_path(circuit)
    values = [_num(scores.get(e)) for e in edges]
    top = max([abs(v) for v in values if v is not None] + [0.0])
    parts = [f'<svg class="circuit" width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
             'role="img" aria-label="the circuit: input at the bottom, logits at the top">']
    for level, l in enumerate(layers, 1):
        parts.append(f'<text class="layer" x="6" y="{y_of(level) + 4:.1f}" font-size="11" fill="#5b6475">L{l}</text>')
    for n in nodes.values():  # a kv node's group: thin grey lines to its query heads
        for h in n.group:
            q = nodes[f"a{n.layer}.h{h}"]
            parts.append(f'<path class="group" d="M{n.x:.1f},{n.y:.1f} L{q.x:.1f},{q.y:.1f}" stroke="#ced4da" '
                         'stroke-width="1" fill="none"/>')
    data = []
    order = sorted(range(len(edges)), key=lambda i: -1.0 if values[i] is None else abs(values[i]))  # strong on top
    for i in order:
        e, (s, r, kind), v = edges[i], ends[i], values[i]
        t = 0.0 if v is None or top == 0 else abs(v) / top
        colour = SIGN_COLOURS[0 if v is None else (1 if v > 0 else -1)]
        dash = f' stroke-dasharray="{DASH[kind]}"' if DASH.get(kind) else ""
        parts.append(f'<line class="edge" data-edge="{html.escape(e, quote=True)}" data-kind="{kind}" '
                     f'data-from="{html.escape(s.name)}" data-to="{html.escape(r.name)}" x1="{s.x:.1f}" '
                     f'y1="{s.top:.1f}" x2="{_port(r, kind):.1f}" y2="{r.bottom:.1f}" stroke="{colour}" '
                     f'stroke-width="{0.75 + 4.25 * t:.2f}" stroke-opacity="{0.2 + 0.8 * t:.2f}"{dash}>'
                     f"<title>{html.escape(e)}: {_fmt(v)}</title></line>")
    for i, e in enumerate(edges):
        data.append({"edge": e, "score": values[i], "kind": ends[i][2], "from": ends[i][0].name,
                     "to": ends[i][1].name})
    fills = {"input": "#e9ecef", "logits": "#e9ecef", "mlp": "#f3f0ff", "kv": "#f8f9fa"}
    for n in nodes.values():
        shown = {"head": n.name[1:], "kv": f"kv{n.index}"}.get(n.kind, n.name)
        fill = "#e7f5ff" if n.label else fills.get(n.kind, "#ffffff")
        w = n.width if n.kind != "kv" else 34
        tip = n.name + (f": {n.label}" if n.label else "")
        if n.kind == "kv":
            tip = (f"a{n.layer} kv head {n.index}: the k and v inputs shared by its query heads"
                   + (f" ({', '.join(f'h{h}' for h in n.group)} in the circuit)" if n.group else ""))
        # a node on no path from the input to the logits (its edges change nothing under patch ablation): faded
        off = on is not None and n.kind in ("head", "mlp") and n.name not in on
        if off:
            tip += " (on no path from the input to the logits)"
        faded = ' opacity="0.5"' if off else ""
        parts.append(f'<g class="node{" off" if off else ""}" data-node="{html.escape(n.name)}" data-kind="{n.kind}"'
                     f'{faded}>'
                     f"<title>{html.escape(tip)}</title>"
                     f'<rect x="{n.x - w / 2:.1f}" y="{n.top:.1f}" width="{w:.0f}" height="{H_NODE}" rx="4" '
                     f'fill="{fill}" stroke="#495057" stroke-width="1"/>'
                     f'<text x="{n.x:.1f}" y="{n.y - (3 if n.label else -4):.1f}" text-anchor="middle" '
                     f'font-size="12">{html.escape(shown)}</text>')
        if n.label:
            short = n.label if len(n.label) <= 11 else n.label[:10] + "\u2026"
            parts.append(f'<text class="label" x="{n.x:.1f}" y="{n.y + 11:.1f}" text-anchor="middle" font-size="9" '
                         f'fill="#0b7285">{html.escape(short)}</text>')
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts), data


def _legend(method: str | None) -> str:
    def sample(colour, dash=""):
        d = f' stroke-dasharray="{dash}"' if dash else ""
        return (f'<svg width="34" height="10"><line x1="1" y1="5" x2="33" y2="5" stroke="{colour}" '
                f'stroke-width="2.5"{d}/></svg>')

    signs = ([sample(SIGN_COLOURS[1]), "how much removing the edge grew ACDC's criterion;"] if method == "acdc" else
             [sample(SIGN_COLOURS[1]), "score &gt; 0 (patching the edge raises the metric)",
              sample(SIGN_COLOURS[-1]), "score &lt; 0 (lowers it);"])
    return ("<div class='note'>" + " ".join([
        *signs,
        sample("#495057"), "into q", sample("#495057", DASH["k"]), "into k", sample("#495057", DASH["v"]),
        "into v (ports left to right on a head's lower edge); width and opacity: |score| against the largest.",
    ]) + "</div>")


# ---- the faithfulness curve ------------------------------------------------------------------------------------------

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
    """The numbers the curve draws, from a :class:`~headlab.interpret.circuits.evaluation.Faithfulness` (or its
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
    mean = [_num(x) for x in _listed(_get(faith, "random_mean"))]
    sd = [_num(x) for x in _listed(_get(faith, "random_sd"))] or [None] * len(mean)
    lo = [None if m is None else m - (d or 0.0) for m, d in zip(mean, sd)]
    hi = [None if m is None else m + (d or 0.0) for m, d in zip(mean, sd)]
    return {"fractions": fractions, "sizes": sizes, "kept": [int(k) for k in _listed(_get(faith, "kept"))],
            "f": [_num(x) for x in _listed(_get(faith, "f"))], "random_lo": lo, "random_mean": mean,
            "random_hi": hi, "cpr": _num(_get(faith, "cpr")), "cmd": _num(_get(faith, "cmd")),
            "source": _get(faith, "source", default="")}


def _svg_curve(pts: dict, own: tuple[float, float] | None = None) -> str:
    """The curve (``own``: the page's circuit as one more point, ``(fraction, f)``, drawn as a diamond)."""
    xs = [x for x in pts["fractions"] + ([own[0]] if own else []) if x and x > 0]
    if not xs:
        return "<p class='note'>no circuit sizes to draw</p>"
    w, h, ml, mr, mt, mb = 560, 300, 52, 16, 14, 42
    ys = [v for k in ("f", "random_lo", "random_hi") for v in pts[k] if v is not None] + [0.0, 1.0] \
        + ([own[1]] if own else [])
    y0, y1 = min(ys), max(ys)
    y0, y1 = y0 - 0.05 * (y1 - y0), y1 + 0.05 * (y1 - y0)
    lx0, lx1 = math.floor(math.log10(min(xs))), max(0, math.ceil(math.log10(max(xs))))
    if lx1 == lx0:
        lx0 -= 1

    def X(frac: float) -> float:
        return ml + (math.log10(frac) - lx0) / (lx1 - lx0) * (w - ml - mr)

    def Y(v: float) -> float:
        return mt + (y1 - v) / (y1 - y0) * (h - mt - mb)

    out = [f'<svg class="faithfulness" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
           'aria-label="faithfulness against the fraction of edges">',
           f'<rect x="{ml}" y="{mt}" width="{w - ml - mr}" height="{h - mt - mb}" fill="#fff" stroke="#c8cdd8"/>']
    for k in range(lx0, lx1 + 1):
        x = X(10.0 ** k)
        label = f"{100 * 10.0 ** k:g}%"
        out.append(f'<line x1="{x:.1f}" y1="{mt}" x2="{x:.1f}" y2="{h - mb}" stroke="#eef0f4"/>'
                   f'<text x="{x:.1f}" y="{h - mb + 14}" text-anchor="middle" font-size="10">{label}</text>')
    step = next(s for s in (0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 50, 100, math.inf) if (y1 - y0) / s <= 8)
    ticks = [i * step for i in range(math.ceil(y0 / step), math.floor(y1 / step) + 1)] if math.isfinite(step) else []
    for v in ticks:
        out.append(f'<line class="grid" x1="{ml}" y1="{Y(v):.1f}" x2="{w - mr}" y2="{Y(v):.1f}" stroke="#eef0f4"/>'
                   f'<text x="{ml - 6}" y="{Y(v) + 4:.1f}" text-anchor="end" font-size="10">{v:g}</text>')
    for v in (0.0, 1.0):  # f = 0 (every edge ablated) and f = 1 (the model)
        out.append(f'<line class="ref" x1="{ml}" y1="{Y(v):.1f}" x2="{w - mr}" y2="{Y(v):.1f}" stroke="#868e96" '
                   'stroke-dasharray="4 3"/>')
    out.append(f'<text x="{(ml + w - mr) / 2:.0f}" y="{h - 6}" text-anchor="middle" font-size="11">fraction of the '
               f"graph's edges in the circuit (log)</text>"
               f'<text x="12" y="{(mt + h - mb) / 2:.0f}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 12 {(mt + h - mb) / 2:.0f})">faithfulness f</text>')
    band = [(X(x), Y(a), Y(b)) for x, a, b in zip(pts["fractions"], pts["random_lo"], pts["random_hi"])
            if x and x > 0 and a is not None and b is not None]
    if band:
        poly = " ".join(f"{x:.1f},{b:.1f}" for x, _, b in band) + " " + \
            " ".join(f"{x:.1f},{a:.1f}" for x, a, _ in reversed(band))
        out.append(f'<polygon class="random-band" points="{poly}" fill="#adb5bd" fill-opacity="0.35" stroke="none">'
                   "<title>random circuits of the same sizes: mean -+ one standard deviation</title></polygon>")
        mean = [(X(x), Y(m)) for x, m in zip(pts["fractions"], pts["random_mean"]) if x and x > 0 and m is not None]
        out.append('<polyline class="random-mean" points="' + " ".join(f"{x:.1f},{y:.1f}" for x, y in mean)
                   + '" fill="none" stroke="#868e96" stroke-dasharray="5 3"/>')
    n = len(pts["fractions"])
    sizes, kept = pts["sizes"] or [None] * n, pts["kept"] or [None] * n
    line = [(X(x), Y(v), x, v, s, k) for x, v, s, k in zip(pts["fractions"], pts["f"], sizes, kept)
            if x and x > 0 and v is not None]
    if line:
        out.append('<polyline class="curve" points="' + " ".join(f"{x:.1f},{y:.1f}" for x, y, *_ in line)
                   + f'" fill="none" stroke="{SIGN_COLOURS[1]}" stroke-width="2"/>')
        for x, y, frac, v, s, k in line:
            size = "" if s is None else f"top {s} edges" + ("" if k is None else f" ({k} after pruning)") + ", "
            out.append(f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{SIGN_COLOURS[1]}">'
                       f"<title>{size}{100 * frac:.3g}% of the edges: f = {v:.4g}</title></circle>")
    if own and own[0] > 0:
        x, y = X(own[0]), Y(own[1])
        out.append(f'<path class="own" d="M{x:.1f},{y - 7:.1f} L{x + 7:.1f},{y:.1f} L{x:.1f},{y + 7:.1f} '
                   f'L{x - 7:.1f},{y:.1f} Z" fill="{SIGN_COLOURS[-1]}" stroke="#fff"><title>this circuit: '
                   f"{100 * own[0]:.3g}% of the edges, f = {own[1]:.4g}</title></path>")
    out.append("</svg>")
    return "".join(out)


def _faithfulness(faith, circuit, n_graph_edges) -> tuple[str, dict]:
    pts = curve_points(faith, n_graph_edges)
    own_f, n_graph = _num(getattr(circuit, "faithfulness", None)), getattr(circuit, "n_graph_edges", None)
    own = (len(circuit.edges) / n_graph, own_f) if own_f is not None and n_graph else None
    stats = []
    if pts["cpr"] is not None:
        stats.append(f"CPR {pts['cpr']:.4g} (area under f: higher is better)")
    if pts["cmd"] is not None:
        stats.append(f"CMD {pts['cmd']:.4g} (area between f and 1: lower is better)")
    note = ("f = (m(circuit) - m(empty)) / (m(model) - m(empty)): 1 is the whole model's behaviour, 0 that of a "
            "circuit with no edge (everything ablated); blue: the top-k edges by the scores"
            + (f" ({pts['source']})" if pts["source"] else "") + " at each size, pruned to the edges on a path; grey: "
            "random circuits of the same sizes (dashed: their mean, band: one standard deviation)"
            + ("; orange diamond: this circuit" if own else ""))
    return (f"<h2>Faithfulness</h2>{_svg_curve(pts, own)}<div class='note'>{html.escape('; '.join(stats))}</div>"
            f"<div class='note'>{html.escape(note)}</div>", pts)


# ---- the page --------------------------------------------------------------------------------------------------------

_JS = r"""
(function(){
function recordError(msg){var p=document.createElement("pre");p.className="selftest-error";p.textContent=msg;
 document.body.appendChild(p);}
window.addEventListener("error",function(e){recordError(String(e.message));});
var D=JSON.parse(document.getElementById("circuit-data").textContent);
var lines=Array.prototype.slice.call(document.querySelectorAll("svg.circuit line.edge"));
function clear(){lines.forEach(function(l){l.classList.remove("hi");l.classList.remove("dim");l.classList.remove("sel");});
 document.querySelectorAll("tr.sel").forEach(function(r){r.classList.remove("sel");});}
function lightNode(name){clear(); lines.forEach(function(l){
 if(l.getAttribute("data-from")===name||l.getAttribute("data-to")===name){l.classList.add("hi");}else{l.classList.add("dim");}});
 document.body.setAttribute("data-focus",name);}
function selectEdge(name){clear(); lines.forEach(function(l){
 if(l.getAttribute("data-edge")===name){l.classList.add("sel");}else{l.classList.add("dim");}});
 document.querySelectorAll("tr[data-edge]").forEach(function(r){if(r.getAttribute("data-edge")===name){r.classList.add("sel");}});
 document.body.setAttribute("data-focus",name);}
document.querySelectorAll("svg.circuit g.node").forEach(function(g){
 g.addEventListener("mouseenter",function(){lightNode(g.getAttribute("data-node"));});
 g.addEventListener("mouseleave",clear);});
document.querySelectorAll("table.edges tr[data-edge]").forEach(function(r){
 r.addEventListener("click",function(){selectEdge(r.getAttribute("data-edge"));});});
function selftest(){
 var problems=[];
 if(lines.length!==D.edges.length){problems.push(lines.length+" edge lines, want "+D.edges.length);}
 var names={}; lines.forEach(function(l){names[l.getAttribute("data-edge")]=true;});
 D.edges.forEach(function(e){if(!names[e.edge]){problems.push("no line for "+e.edge);}});
 var row=document.querySelector("table.edges tr[data-edge]");
 if(row){row.dispatchEvent(new MouseEvent("click",{bubbles:true}));
  var sel=document.querySelectorAll("svg.circuit line.edge.sel");
  if(sel.length!==1||sel[0].getAttribute("data-edge")!==row.getAttribute("data-edge")){problems.push("a click on the first row did not select its edge");}}
 if(D.curve){var pts=document.querySelectorAll("svg.faithfulness circle.point").length, want=0;
  D.curve.f.forEach(function(v,i){if(v!==null&&D.curve.fractions[i]>0){want++;}});
  if(pts!==want){problems.push(pts+" curve points, want "+want);}}
 var out=document.createElement("pre"); out.id="selftest-result"; out.setAttribute("data-status",problems.length?"fail":"pass");
 out.setAttribute("data-checked-edges",String(lines.length));
 out.textContent=problems.length?problems.join("\n"):"selftest pass"; document.body.appendChild(out);
}
if(location.hash==="#selftest"){try{selftest();}catch(e){recordError("selftest threw: "+e);}}
})();
"""

_CSS = """<style>
svg.circuit { background: #fff; border: 1px solid #c8cdd8; }
svg.circuit line.edge.dim { stroke-opacity: 0.06; }
svg.circuit line.edge.hi, svg.circuit line.edge.sel { stroke-opacity: 1; }
svg.circuit g.node { cursor: default; }
table.edges tr.sel td { background: #fff0e6; }
table.edges td.num { text-align: right; font-variant-numeric: tabular-nums; }
</style>"""


def _table(circuit, data: list[dict], labels: dict[str, str], top: int) -> str:
    ranked = sorted(data, key=lambda d: -1.0 if d["score"] is None else abs(d["score"]), reverse=True)[:top]
    total = sum(abs(d["score"]) for d in data if d["score"] is not None) or 1.0
    rows = []
    for i, d in enumerate(ranked, 1):
        s, node = d["from"], d["to"]
        who = "; ".join(x for x in (f"{s}: {labels[s]}" if s in labels else "",
                                    f"{node}: {labels[node]}" if node in labels else "") if x)
        share = "" if d["score"] is None else f"{100 * abs(d['score']) / total:.1f}%"
        rows.append(f'<tr data-edge="{html.escape(d["edge"], quote=True)}"><td class="num">{i}</td>'
                    f'<td class="text"><code>{html.escape(d["edge"])}</code></td><td class="text">{d["kind"]}</td>'
                    f'<td class="num">{_fmt(d["score"])}</td><td class="num">{share}</td>'
                    f'<td class="text">{html.escape(who)}</td></tr>')
    more = len(data) - len(ranked)
    tail = f"<div class='note'>{more} more edges in the circuit (every edge is in the page's data)</div>" if more > 0 \
        else ""
    return (f"<h2>Top edges</h2><table class='stats edges'><tr><th>#</th><th class='text'>edge</th>"
            "<th class='text'>input</th><th>score</th><th>share of |score|</th><th class='text'>labels</th></tr>"
            f"{''.join(rows)}</table>{tail}<div class='note'>{html.escape(_score_note(circuit))}</div>")


def _score_note(circuit) -> str:
    if getattr(circuit, "method", None) == "acdc":
        return ("score: how much removing the edge grew ACDC's criterion when it was tried (the edges kept are those "
                "whose removal grew it past the threshold)")
    how = (getattr(circuit, "settings", None) or {}).get("score_method")
    return ("score: the change of the metric's mean when this edge alone carries the corrupted run's sender output "
            f"(m_patched - m_clean){f', as {how} estimated it' if how else ''}")


def render(circuit, faithfulness=None, labels=None, *, graph=None, top: int = 30, title: str | None = None) -> str:
    """The whole page of one circuit.

    Args:
        circuit: a :class:`~headlab.interpret.circuits.circuit.Circuit` (``model``, ``edges``, ``scores``,
            ``method``, ``n_graph_edges``, ``ablation``), or anything with those attributes.
        faithfulness: its :class:`~headlab.interpret.circuits.evaluation.Faithfulness` (or that result's JSON
            dict), drawn as the curve; None leaves the curve out.
        labels: the heads' roles, ``{"a3.h2": "induction"}`` (``"3.2"`` and ``(3, 2)`` keys too; a value may be a
            list) or an :class:`~headlab.interpret.atlas.result.Atlas`.
        graph: the model's :class:`~headlab.interpret.circuits.graph.Graph`, when the circuit does not carry its
            heads and kv heads per layer: on a grouped-query model it joins each kv node to its query heads, on
            one kv head per query head it ends k and v edges on the heads themselves.
        top: rows of the edge table. title: the page's (default ``circuit: MODEL``).
    """
    names = head_labels(labels)
    edges = list(circuit.edges)
    model = getattr(circuit, "model", "") or "model"
    n_graph = getattr(circuit, "n_graph_edges", None)
    svg, data = _svg_circuit(circuit, names, graph)
    share = f" ({100 * len(edges) / n_graph:.3g}% of the graph's {n_graph})" if n_graph else ""
    node_names = {n for e in edges for n in _split(e)}
    summary = [f"{model}: {len(edges)} edges{share}, {len(node_names)} nodes; method "
               f"{getattr(circuit, 'method', None) or 'n/a'}, ablation {getattr(circuit, 'ablation', None) or 'n/a'}"]
    figures = [(name, _num(getattr(circuit, attr, None))) for name, attr in (
        ("clean", "clean"), ("corrupted", "corrupted"), ("every edge ablated", "empty"),
        ("the circuit alone", "circuit_metric"))]
    if any(v is not None for _, v in figures):
        f = _num(getattr(circuit, "faithfulness", None))  # Circuit.faithfulness: the circuit's own f, or None
        summary.append(f"metric {getattr(circuit, 'metric', None) or 'm'}: "
                       + ", ".join(f"{k} {v:.4g}" for k, v in figures if v is not None)
                       + ("" if f is None else f"; f = {f:.3g}"))
    notes = list(getattr(circuit, "notes", None) or [])
    in_circuit = sorted(k for k in names if k in node_names)
    if in_circuit:
        summary.append("labelled heads in the circuit: " + ", ".join(f"{k} ({names[k]})" for k in in_circuit[:12])
                       + (" ..." if len(in_circuit) > 12 else ""))
    body = [_CSS, "<h2>Circuit</h2>"]
    body.append(svg if edges else svg + "<p class='note'>the circuit has no edges</p>")
    body.append(_legend(getattr(circuit, "method", None)))
    curve = None
    if faithfulness is not None:
        part, curve = _faithfulness(faithfulness, circuit, n_graph)
        body.append(part)
        stats = [f"{k.upper()} {curve[k]:.4g}" for k in ("cpr", "cmd") if curve[k] is not None]
        if stats:
            summary.append("faithfulness: " + ", ".join(stats))
    body.append(_table(circuit, data, names, top))
    return shell.page(title=title or f"circuit: {model}", body="\n".join(body), summary_lines=summary,
                      banner="; ".join(notes) if notes else None,
                      data={"edges": data, "curve": curve}, data_id="circuit-data", script=_JS,
                      generator="headlab circuit")


def inline(circuit, faithfulness=None, labels=None, **kw) -> str:
    """The page in a notebook (``Circuit._repr_html_``): :func:`render` in headlab's sandboxed frame."""
    return shell.inline(render(circuit, faithfulness, labels, **kw))


def write(path: str | os.PathLike, circuit, faithfulness=None, labels=None, **kw) -> Path:
    """Write :func:`render`'s page to ``path`` (atomically, :func:`headlab.results.write_text`)."""
    from headlab.results import write_text

    return write_text(path, render(circuit, faithfulness, labels, **kw))
