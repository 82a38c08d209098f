"""The circuit page's drawing of the circuit (:mod:`headlab.interpret.circuits.page` puts it on the page).

:func:`svg_circuit` draws layers up the page (the input at the bottom, the logits at the top), a layer's heads side
by side with its MLP beside them and half a row higher (a sequential MLP reads its own layer's heads, so every edge
runs upwards); one ``<line class="edge">`` per edge, its width and opacity following ``|score|``, its colour the
score's sign (:data:`SIGN_COLOURS`). A head's inputs are three ports on its lower edge, ``q`` left, ``k`` middle,
``v`` right, and the line's dash says which (:data:`DASH`): ``q`` solid, ``k`` dashed, ``v`` dotted. On a
grouped-query model (``k``/``v`` are per *kv head*, shared by ``H / Hkv`` query heads) the k and v edges end on a
small node of their own, ``kv{g}``, joined by a thin grey line to the group's query heads in the circuit. The
heads' labels (the atlas's roles) are written in their nodes; :func:`legend` explains the lines.

    >>> from types import SimpleNamespace as C
    >>> c = C(edges=["input->a0.h0<q>", "a0.h0->a1.h0<k>", "a1.h0->logits"], scores={"a1.h0->logits": 2.0})
    >>> svg, data = svg_circuit(c, {"a0.h0": "previous-token"}, None)
    >>> svg.count('<line class="edge"'), [d["kind"] for d in data], data[1]["to"]
    (3, ['q', 'k', 'logits'], 'a1.kv0')
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass, field

__all__ = ["DASH", "SIGN_COLOURS", "as_number", "fmt_number", "legend", "split_edge", "svg_circuit"]

# ---- names -------------------------------------------------------------------------------------------------------

_HEAD = re.compile(r"^a(\d+)\.h(\d+)$")
_MLP = re.compile(r"^m(\d+)$")
_RECEIVER = re.compile(r"^a(\d+)\.h(\d+)<([qkv])>$")
SIGN_COLOURS = {1: "#1971c2", -1: "#e8590c", 0: "#868e96"}  # score > 0, < 0, unknown
DASH = {"q": "", "k": "7 4", "v": "2 3"}  # a head's three inputs; MLP and logits edges are solid


def split_edge(edge: str) -> tuple[str, str]:
    """``(sender, receiver)`` of an edge name ``"sender->receiver"``."""
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
    nodes: dict[str, _Node] = {
        "input": _Node("input", "input", None, width=80),
        "logits": _Node("logits", "logits", None, width=80),
    }
    ends = []
    for e in edges:
        s, r = split_edge(e)
        got = []
        for name, kind, layer, index in (_sender_node(s), _receiver_node(r, groups)):
            if name not in nodes:
                nodes[name] = _Node(name, kind, layer, index, label=labels.get(name, ""))
            got.append(nodes[name])
        ends.append((got[0], got[1], _kind(r)))
    if groups is not None:  # a kv node's query heads: those of its group that the circuit holds
        for n in nodes.values():
            if n.kind == "kv" and n.layer is not None and n.layer < len(groups[0]) and groups[1][n.layer]:
                per = groups[0][n.layer] // groups[1][n.layer]
                n.group = [h for h in range(n.index * per, (n.index + 1) * per) if f"a{n.layer}.h{h}" in nodes]
    layers = sorted({n.layer for n in nodes.values() if n.layer is not None})
    rows = {
        l: sorted(
            (n for n in nodes.values() if n.layer == l and n.kind in ("head", "kv")),
            key=lambda n: (n.kind == "kv", n.index),
        )
        for l in layers
    }
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


def as_number(v) -> float | None:
    """``v`` as a float, None when it is missing, not a number or NaN."""
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def fmt_number(v: float | None) -> str:
    """Four significant digits, ``n/a`` for None."""
    return "n/a" if v is None else f"{v:.4g}"


def _on_path(circuit) -> set[str] | None:
    """The nodes on a path from the input to the logits (:attr:`Circuit.nodes`), or None when not known."""
    try:
        on = getattr(circuit, "nodes", None)
    except Exception:  # noqa: BLE001  (a circuit whose graph cannot be rebuilt: every node drawn alike)
        return None
    return set(on) if isinstance(on, (list, tuple, set)) else None


def svg_circuit(circuit, labels: dict[str, str], graph) -> tuple[str, list[dict]]:
    """The circuit as ``<svg class="circuit">`` and, per edge, the page's data: ``edge``, ``score``, ``kind``
    (``q``, ``k``, ``v``, ``mlp`` or ``logits``), ``from`` and ``to`` (the nodes its line joins).

    ``labels``: :func:`~headlab.interpret.circuits.page.head_labels`' dict; ``graph``: as
    :func:`~headlab.interpret.circuits.page.render` takes it (the heads and kv heads per layer), or None.
    """
    edges = list(circuit.edges)
    scores = getattr(circuit, "scores", None) or {}
    nodes, ends, layers, width, height, y_of = _layout(edges, _groups(circuit, graph), labels)
    on = _on_path(circuit)
    values = [as_number(scores.get(e)) for e in edges]
    top = max([abs(v) for v in values if v is not None] + [0.0])
    parts = [
        f'<svg class="circuit" width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
        'role="img" aria-label="the circuit: input at the bottom, logits at the top">'
    ]
    for level, l in enumerate(layers, 1):
        parts.append(f'<text class="layer" x="6" y="{y_of(level) + 4:.1f}" font-size="11" fill="#5b6475">L{l}</text>')
    for n in nodes.values():  # a kv node's group: thin grey lines to its query heads
        for h in n.group:
            q = nodes[f"a{n.layer}.h{h}"]
            parts.append(
                f'<path class="group" d="M{n.x:.1f},{n.y:.1f} L{q.x:.1f},{q.y:.1f}" stroke="#ced4da" '
                'stroke-width="1" fill="none"/>'
            )
    data = []
    order = sorted(range(len(edges)), key=lambda i: -1.0 if (v := values[i]) is None else abs(v))  # strong on top
    for i in order:
        e, (s, r, kind), v = edges[i], ends[i], values[i]
        t = 0.0 if v is None or top == 0 else abs(v) / top
        colour = SIGN_COLOURS[0 if v is None else (1 if v > 0 else -1)]
        dash = f' stroke-dasharray="{DASH[kind]}"' if DASH.get(kind) else ""
        parts.append(
            f'<line class="edge" data-edge="{html.escape(e, quote=True)}" data-kind="{kind}" '
            f'data-from="{html.escape(s.name)}" data-to="{html.escape(r.name)}" x1="{s.x:.1f}" '
            f'y1="{s.top:.1f}" x2="{_port(r, kind):.1f}" y2="{r.bottom:.1f}" stroke="{colour}" '
            f'stroke-width="{0.75 + 4.25 * t:.2f}" stroke-opacity="{0.2 + 0.8 * t:.2f}"{dash}>'
            f"<title>{html.escape(e)}: {fmt_number(v)}</title></line>"
        )
    for i, e in enumerate(edges):
        data.append({"edge": e, "score": values[i], "kind": ends[i][2], "from": ends[i][0].name, "to": ends[i][1].name})
    fills = {"input": "#e9ecef", "logits": "#e9ecef", "mlp": "#f3f0ff", "kv": "#f8f9fa"}
    for n in nodes.values():
        shown = {"head": n.name[1:], "kv": f"kv{n.index}"}.get(n.kind, n.name)
        fill = "#e7f5ff" if n.label else fills.get(n.kind, "#ffffff")
        w = n.width if n.kind != "kv" else 34
        tip = n.name + (f": {n.label}" if n.label else "")
        if n.kind == "kv":
            tip = f"a{n.layer} kv head {n.index}: the k and v inputs shared by its query heads" + (
                f" ({', '.join(f'h{h}' for h in n.group)} in the circuit)" if n.group else ""
            )
        # a node on no path from the input to the logits (its edges change nothing under patch ablation): faded
        off = on is not None and n.kind in ("head", "mlp") and n.name not in on
        if off:
            tip += " (on no path from the input to the logits)"
        faded = ' opacity="0.5"' if off else ""
        parts.append(
            f'<g class="node{" off" if off else ""}" data-node="{html.escape(n.name)}" data-kind="{n.kind}"'
            f'{faded}>'
            f"<title>{html.escape(tip)}</title>"
            f'<rect x="{n.x - w / 2:.1f}" y="{n.top:.1f}" width="{w:.0f}" height="{H_NODE}" rx="4" '
            f'fill="{fill}" stroke="#495057" stroke-width="1"/>'
            f'<text x="{n.x:.1f}" y="{n.y - (3 if n.label else -4):.1f}" text-anchor="middle" '
            f'font-size="12">{html.escape(shown)}</text>'
        )
        if n.label:
            short = n.label if len(n.label) <= 11 else n.label[:10] + "\u2026"
            parts.append(
                f'<text class="label" x="{n.x:.1f}" y="{n.y + 11:.1f}" text-anchor="middle" font-size="9" '
                f'fill="#0b7285">{html.escape(short)}</text>'
            )
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts), data


def legend(method: str | None) -> str:
    """The note under the drawing: what the lines' colours, dashes and widths say."""

    def sample(colour, dash=""):
        d = f' stroke-dasharray="{dash}"' if dash else ""
        return (
            f'<svg width="34" height="10"><line x1="1" y1="5" x2="33" y2="5" stroke="{colour}" '
            f'stroke-width="2.5"{d}/></svg>'
        )

    signs = (
        [sample(SIGN_COLOURS[1]), "how much removing the edge grew ACDC's criterion;"]
        if method == "acdc"
        else [
            sample(SIGN_COLOURS[1]),
            "score &gt; 0 (patching the edge raises the metric)",
            sample(SIGN_COLOURS[-1]),
            "score &lt; 0 (lowers it);",
        ]
    )
    return (
        "<div class='note'>"
        + " ".join(
            [
                *signs,
                sample("#495057"),
                "into q",
                sample("#495057", DASH["k"]),
                "into k",
                sample("#495057", DASH["v"]),
                "into v (ports left to right on a head's lower edge); width and opacity: |score| against the largest.",
            ]
        )
        + "</div>"
    )
