"""The circuit page: one self-contained file in headlab's shell (:mod:`headlab.interpret.shell`; no network).

- **the circuit** as SVG (:mod:`~headlab.interpret.circuits.page_circuit`): layers up the page, the input at the
  bottom and the logits at the top, one ``<line class="edge">`` per edge, its width and opacity following
  ``|score|``, its colour the score's sign, its dash the head input it enters (``q``, ``k``, ``v``); on a
  grouped-query model the k and v edges end on a node of their own per kv head;
- the heads' **labels** (the atlas's roles, ``{"a3.h2": "induction"}`` or an
  :class:`~headlab.interpret.atlas.result.Atlas`, read by :func:`head_labels`) written in their nodes;
- the **faithfulness curve** when given (:mod:`~headlab.interpret.circuits.page_curve`): f against the fraction of
  the graph's edges kept (log x), the circuit's curve over the band of the random circuits of the same sizes
  (mean -+ one sd), the circuit itself as a diamond, with CPR and CMD;
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
import os
import re
from pathlib import Path

from headlab.interpret import shell
from headlab.interpret.circuits.page_circuit import as_number, fmt_number, legend, split_edge, svg_circuit
from headlab.interpret.circuits.page_curve import curve_points, faithfulness_section

__all__ = ["curve_points", "head_labels", "inline", "render", "write"]

# ---- labels --------------------------------------------------------------------------------------------------------


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

        raise InputError(
            f"labels: give a dict such as {{'a3.h2': 'induction'}} or an atlas result, not {type(labels).__name__}"
        )
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
        who = "; ".join(
            x
            for x in (f"{s}: {labels[s]}" if s in labels else "", f"{node}: {labels[node]}" if node in labels else "")
            if x
        )
        share = "" if d["score"] is None else f"{100 * abs(d['score']) / total:.1f}%"
        rows.append(
            f'<tr data-edge="{html.escape(d["edge"], quote=True)}"><td class="num">{i}</td>'
            f'<td class="text"><code>{html.escape(d["edge"])}</code></td><td class="text">{d["kind"]}</td>'
            f'<td class="num">{fmt_number(d["score"])}</td><td class="num">{share}</td>'
            f'<td class="text">{html.escape(who)}</td></tr>'
        )
    more = len(data) - len(ranked)
    tail = (
        f"<div class='note'>{more} more edges in the circuit (every edge is in the page's data)</div>"
        if more > 0
        else ""
    )
    return (
        f"<h2>Top edges</h2><table class='stats edges'><tr><th>#</th><th class='text'>edge</th>"
        "<th class='text'>input</th><th>score</th><th>share of |score|</th><th class='text'>labels</th></tr>"
        f"{''.join(rows)}</table>{tail}<div class='note'>{html.escape(_score_note(circuit))}</div>"
    )


def _score_note(circuit) -> str:
    if getattr(circuit, "method", None) == "acdc":
        return (
            "score: how much removing the edge grew ACDC's criterion when it was tried (the edges kept are those "
            "whose removal grew it past the threshold)"
        )
    how = (getattr(circuit, "settings", None) or {}).get("score_method")
    return (
        "score: the change of the metric's mean when this edge alone carries the corrupted run's sender output "
        f"(m_patched - m_clean){f', as {how} estimated it' if how else ''}"
    )


def render(circuit, faithfulness=None, labels=None, *, graph=None, top: int = 30, title: str | None = None) -> str:
    """The whole page of one circuit.

    Args:
        circuit: a :class:`~headlab.interpret.circuits.circuit.Circuit` (``model``, ``edges``, ``scores``,
            ``method``, ``n_graph_edges``, ``ablation``), or anything with those attributes.
        faithfulness: its :class:`~headlab.interpret.circuits.Faithfulness` (or that result's JSON
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
    svg, data = svg_circuit(circuit, names, graph)
    share = f" ({100 * len(edges) / n_graph:.3g}% of the graph's {n_graph})" if n_graph else ""
    node_names = {n for e in edges for n in split_edge(e)}
    on_path = getattr(circuit, "nodes", None)  # a Circuit's nodes on a path from the input to the logits
    n_nodes = len(on_path) if on_path is not None else len(node_names)
    summary = [
        f"{model}: {len(edges)} edges{share}, {n_nodes} nodes; method "
        f"{getattr(circuit, 'method', None) or 'n/a'}, ablation {getattr(circuit, 'ablation', None) or 'n/a'}"
    ]
    figures = [
        (name, as_number(getattr(circuit, attr, None)))
        for name, attr in (
            ("clean", "clean"),
            ("corrupted", "corrupted"),
            ("every edge ablated", "empty"),
            ("the circuit alone", "circuit_metric"),
        )
    ]
    if any(v is not None for _, v in figures):
        f = as_number(getattr(circuit, "faithfulness", None))  # Circuit.faithfulness: the circuit's own f, or None
        summary.append(
            f"metric {getattr(circuit, 'metric', None) or 'm'}: "
            + ", ".join(f"{k} {v:.4g}" for k, v in figures if v is not None)
            + ("" if f is None else f"; f = {f:.3g}")
        )
    notes = list(getattr(circuit, "notes", None) or [])
    in_circuit = sorted(k for k in names if k in node_names)
    if in_circuit:
        summary.append(
            "labelled heads in the circuit: "
            + ", ".join(f"{k} ({names[k]})" for k in in_circuit[:12])
            + (" ..." if len(in_circuit) > 12 else "")
        )
    body = [_CSS, "<h2>Circuit</h2>"]
    body.append(svg if edges else svg + "<p class='note'>the circuit has no edges</p>")
    body.append(legend(getattr(circuit, "method", None)))
    curve = None
    if faithfulness is not None:
        part, curve = faithfulness_section(faithfulness, circuit, n_graph)
        body.append(part)
        stats = [f"{k.upper()} {curve[k]:.4g}" for k in ("cpr", "cmd") if curve[k] is not None]
        if stats:
            summary.append("faithfulness: " + ", ".join(stats))
    body.append(_table(circuit, data, names, top))
    return shell.page(
        title=title or f"circuit: {model}",
        body="\n".join(body),
        summary_lines=summary,
        banner="; ".join(notes) if notes else None,
        data={"edges": data, "curve": curve},
        data_id="circuit-data",
        script=_JS,
        generator="headlab circuit",
    )


def inline(circuit, faithfulness=None, labels=None, **kw) -> str:
    """The page in a notebook (``Circuit._repr_html_``): :func:`render` in headlab's sandboxed frame."""
    return shell.inline(render(circuit, faithfulness, labels, **kw))


def write(path: str | os.PathLike, circuit, faithfulness=None, labels=None, **kw) -> Path:
    """Write :func:`render`'s page to ``path`` (atomically, :func:`headlab.results.write_text`)."""
    from headlab.results import write_text

    return write_text(path, render(circuit, faithfulness, labels, **kw))
