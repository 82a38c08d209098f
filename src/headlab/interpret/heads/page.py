"""The ``headlab heads`` HTML page: one self-contained file in headlab's shell (:mod:`headlab.interpret.shell`:
inline stylesheet, script and data; no network).

Sections, each when its result is given: layers x heads heatmaps of importance, confidence and
single-ablation effect; the pair-interaction matrix of the k lowest-effect heads; the verdict table;
the pruning curve (its PNG inline) and the measured savings. Clicking a heatmap cell (or hovering
it) selects that head: its verdict row is highlighted and a line says its numbers.

Opening the page with ``#selftest`` makes it check itself (every heatmap has one cell per head with
a colour, the interaction matrix k x k cells, a synthetic click selects the right verdict row) and
write ``<pre id="selftest-result" data-status="pass|fail">`` into the document; script errors are
written too (``<pre class="selftest-error">``), as on the ``analyze`` page.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from headlab.interpret import shell

_JS = r"""
(function(){
function recordError(msg){var p=document.createElement("pre");p.className="selftest-error";p.textContent=msg;
 document.body.appendChild(p);}
window.addEventListener("error",function(e){recordError(String(e.message));});
var DATA=JSON.parse(document.getElementById("heads-data").textContent);
function select(l,h){
 document.querySelectorAll("td.sel,tr.sel").forEach(function(e){e.classList.remove("sel");});
 document.querySelectorAll('td[data-l="'+l+'"][data-h="'+h+'"]').forEach(function(e){e.classList.add("sel");});
 var row=document.getElementById("v-"+l+"-"+h); if(row){row.classList.add("sel");}
 var parts=[]; (DATA.grids||[]).forEach(function(g){var v=g.values[l]&&g.values[l][h];
  parts.push(g.name+"="+(v===null||v===undefined?"n/a":Number(v).toPrecision(3)));});
 var vd=(DATA.verdicts||{})[l+"."+h]; if(vd){parts.push(vd);}
 document.getElementById("focus").textContent="head "+l+"."+h+": "+parts.join(", ");
 document.body.dataset.focus=l+"."+h;
}
document.querySelectorAll("table.hm td[data-l]").forEach(function(td){
 var f=function(){select(td.dataset.l,td.dataset.h);}; td.addEventListener("click",f); td.addEventListener("mouseenter",f);});
function selftest(){
 var problems=[];
 (DATA.grids||[]).forEach(function(g){
  var cells=document.querySelectorAll('table[data-grid="'+g.name+'"] td[data-l]');
  var want=0; g.values.forEach(function(r){want+=r.length;});
  if(cells.length!==want){problems.push(g.name+": "+cells.length+" cells, want "+want);}
  cells.forEach(function(c){if(!c.style.backgroundColor){problems.push(g.name+": a cell without colour");}});});
 if(DATA.k){var ic=document.querySelectorAll('table[data-grid="interaction"] td.ic');
  if(ic.length!==DATA.k*DATA.k){problems.push("interaction: "+ic.length+" cells, want "+DATA.k*DATA.k);}}
 var first=document.querySelector("table.hm td[data-l]");
 if(first){first.dispatchEvent(new MouseEvent("click",{bubbles:true}));
  var key=first.dataset.l+"."+first.dataset.h;
  if(document.body.dataset.focus!==key){problems.push("click did not select "+key);}
  if(DATA.verdicts&&DATA.verdicts[key]&&!document.querySelector("tr.sel")){problems.push("verdict row not highlighted");}}
 var out=document.createElement("pre"); out.id="selftest-result"; out.dataset.status=problems.length?"fail":"pass";
 out.dataset.checkedGrids=String((DATA.grids||[]).length);
 out.textContent=problems.length?problems.join("\n"):"selftest pass"; document.body.appendChild(out);
}
if(location.hash==="#selftest"){try{selftest();}catch(e){recordError("selftest threw: "+e);}}
})();
"""


def _colour(v, lo, hi, diverging=False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "#eeeeee"
    if diverging:
        m = max(abs(lo), abs(hi)) or 1.0
        t = max(-1.0, min(1.0, v / m))
        if t >= 0:
            return f"rgb(255,{int(255 - 180 * t)},{int(255 - 200 * t)})"
        return f"rgb({int(255 + 200 * t)},{int(255 + 130 * t)},255)"
    t = 0.0 if hi == lo else (v - lo) / (hi - lo)
    t = max(0.0, min(1.0, t))
    return f"rgb({int(250 - 220 * t)},{int(250 - 160 * t)},{int(255 - 60 * t)})"


def _clean(grid) -> list[list[float | None]]:
    rows = grid.tolist() if hasattr(grid, "tolist") else grid
    return [[None if (x is None or (isinstance(x, float) and math.isnan(x))) else float(x) for x in r] for r in rows]


def _heatmap(name: str, grid, diverging=False) -> str:
    vals = [x for r in grid for x in r if x is not None]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    head = "".join(f"<th>{h}</th>" for h in range(max(len(r) for r in grid)))
    rows = []
    for l, r in enumerate(grid):
        cells = "".join(
            f'<td data-l="{l}" data-h="{h}" title="{l}.{h}: {"n/a" if v is None else f"{v:.4g}"}" '
            f'style="background-color:{_colour(v, lo, hi, diverging)}"></td>'
            for h, v in enumerate(r)
        )
        rows.append(f"<tr><th>{l}</th>{cells}</tr>")
    rng = f"{lo:.3g} .. {hi:.3g}" if vals else "no values"
    return (
        f'<div><h3 style="font-size:14px">{html.escape(name)}</h3><table class="hm" data-grid="{html.escape(name)}">'
        f"<tr><th></th>{head}</tr>{''.join(rows)}</table><div class='note'>layers down, heads across; {rng}</div></div>"
    )


def render_page(
    *, title: str, importance=None, ablation=None, curve=None, curve_png: Path | None = None, savings=None
) -> str:
    """The page for any of an ImportanceResult, an AblationResult, a PruningCurve and Savings."""
    grids, body = [], []
    if importance is not None:
        grids.append(("importance", _clean(importance.importance)))
        grids.append(("importance (normalised)", _clean(importance.normalized)))
        if importance.confidence is not None:
            grids.append(("confidence", _clean(importance.confidence)))
    if ablation is not None:
        grids.append((f"single effect ({ablation.kind})", _clean(ablation.single)))
        if ablation.keep_one is not None:
            grids.append(("keep only this head in its layer", _clean(ablation.keep_one)))
    if grids:
        body.append(
            "<h2>Per head</h2><div class='grids'>"
            + "".join(_heatmap(n, g, diverging=n.startswith("single")) for n, g in grids)
            + "</div><div id='focus'></div>"
        )
    verdicts = {}
    k = 0
    if ablation is not None:
        k = len(ablation.pair_heads)
        inter = _clean(ablation.interaction)
        if k:
            vals = [x for r in inter for x in r if x is not None]
            lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
            hdr = "".join(f"<th>{a}.{b}</th>" for a, b in ablation.pair_heads)
            rows = []
            for i, (a, b) in enumerate(ablation.pair_heads):
                cells = "".join(
                    f'<td class="ic" title="I({a}.{b}, {c}.{d}) = {"n/a" if v is None else f"{v:.4g}"}" '
                    f'style="background-color:{_colour(v, lo, hi, True)}"></td>'
                    for (c, d), v in zip(ablation.pair_heads, inter[i])
                )
                rows.append(f"<tr><th>{a}.{b}</th>{cells}</tr>")
            body.append(
                f"<h2>Pair interactions I(h, g) = E(h, g) - E(h) - E(g) ({k} lowest-effect heads)</h2>"
                f'<table class="hm" data-grid="interaction"><tr><th></th>{hdr}</tr>{"".join(rows)}</table>'
                f"<div class='note'>red: removing both costs more than the two alone (redundancy); "
                f"threshold {ablation.threshold:.3g}, noise floor {ablation.floor_text()}</div>"
            )
        rows = []
        for v in ablation.verdicts:
            verdicts[f"{v.layer}.{v.head}"] = v.label()
            rows.append(
                f'<tr id="v-{v.layer}-{v.head}"><td>{v.layer}.{v.head}</td><td>{html.escape(v.label())}</td>'
                f"<td>{html.escape(v.evidence)}</td></tr>"
            )
        counts = ", ".join(f"{n} {c}" for c, n in ablation.counts().items())
        body.append(
            f"<h2>Verdicts ({html.escape(counts)})</h2><div class='note'>{html.escape(json.dumps(ablation.thresholds))}"
            f"</div><table class='vt'><tr><th>head</th><th>verdict</th><th>evidence</th></tr>{''.join(rows)}</table>"
        )
    if curve is not None:
        img = ""
        if curve_png is not None and Path(curve_png).is_file():
            img = f'<img alt="pruning curve" src="data:image/png;base64,{base64.b64encode(Path(curve_png).read_bytes()).decode()}">'
        pts = "".join(
            f"<tr><td>{100 * f:.0f}%</td><td>{v:.4g}</td></tr>" for f, v in zip(curve.fractions, curve.values)
        )
        body.append(
            f"<h2>Pruning curve: {html.escape(curve.summary())}</h2>{img}"
            f"<table class='vt'><tr><th>removed</th><th>{curve.metric}</th></tr>{pts}</table>"
        )
    if savings is not None:
        srows = "".join(
            f"<tr><td>{100 * r['fraction_removed']:.0f}%</td><td>{r['batch']}</td>"
            f"<td>{r['unpruned_examples_per_s']:.1f}</td><td>{r['pruned_examples_per_s']:.1f}</td>"
            f"<td>{r['throughput_gain_pct']:+.1f}%</td><td>{r['params']:,}</td></tr>"
            for r in savings.rows
        )
        body.append(
            "<h2>Measured savings</h2><table class='vt'><tr><th>removed</th><th>batch</th><th>unpruned ex/s</th>"
            f"<th>pruned ex/s</th><th>gain</th><th>parameters</th></tr>{srows}</table>"
        )
    data = {"grids": [{"name": n, "values": g} for n, g in grids], "verdicts": verdicts, "k": k}
    return shell.page(
        title=title, body="".join(body), data=data, data_id="heads-data", script=_JS, generator="headlab heads"
    )


def head_annotations(result_or_path) -> dict[tuple[int, int], str]:
    """``(layer, head) -> short text`` (importance rank, single effect, verdict) for ``headlab analyze``.

    Accepts an ImportanceResult, an AblationResult, their ``to_json()`` dicts, or a path to a JSON
    file written by ``headlab heads importance|ablate`` (``importance.json`` / ``ablation.json``)."""
    obj = result_or_path
    if isinstance(obj, (str, Path)):
        from headlab.reading import read_json_file

        obj = read_json_file(obj, what="the importance.json or ablation.json headlab heads importance|ablate wrote")
    if hasattr(obj, "to_json"):
        obj = obj.to_json()
    if not isinstance(obj, dict):
        from headlab.errors import InputError

        raise InputError(f"head_annotations needs a heads result or its JSON file, got {type(obj).__name__}")
    out: dict[tuple[int, int], str] = {}

    def add(key, text):
        out[key] = f"{out[key]}; {text}" if key in out else text

    if obj.get("importance") is not None:
        grid = obj["importance"]
        flat = sorted(((v, l, h) for l, r in enumerate(grid) for h, v in enumerate(r) if v is not None), reverse=True)
        for rank, (v, l, h) in enumerate(flat, 1):
            add((l, h), f"importance {v:.3g} (rank {rank}/{len(flat)})")
    if obj.get("single") is not None:
        for l, r in enumerate(obj["single"]):
            for h, v in enumerate(r):
                if v is not None:
                    add((l, h), f"{obj.get('kind', '')} ablation +{v:.3g}" if v >= 0 else f"ablation {v:.3g}")
    for v in obj.get("verdicts", []) or []:
        add((v["layer"], v["head"]), v["label"])
    for key in ("importance_result", "ablation_result"):
        if isinstance(obj.get(key), dict):
            for k2, t in head_annotations(obj[key]).items():
                add(k2, t)
    return out
