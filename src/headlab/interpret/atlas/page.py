"""The atlas page: one self-contained file in headlab's shell (:mod:`headlab.interpret.shell`; no network).

- the role grid: layers down, query heads across (GQA: the kv group under each head number), each cell
  coloured by the head's strongest role (its score over the kind's threshold) and lettered with every role
  it carries; clicking or hovering a cell writes its scores, roles and the verdicts of its kinds below, and
  draws its evidence maps (:mod:`.evidence`) when it is among a kind's top heads;
- one heatmap per score (every kind and the OV copying score);
- the causal checks: per kind the task, the top-k heads, the targeted effect with its interval, the random
  draws' mean and largest upper end, and the verdict.

Opening the page with ``#selftest`` makes it check itself (every grid has one coloured cell per head, a
synthetic click on the first cell fills the focus line with every kind's score, a click on a head with
evidence draws its maps at the right size and colour, one table row per verdict)
and write ``<pre id="selftest-result" data-status="pass|fail">``; script errors are written too
(``<pre class="selftest-error">``), as on headlab's other pages.
"""

from __future__ import annotations

import html
import math

from headlab.interpret import shell
from headlab.interpret.atlas.kinds import KINDS, ROLE
from headlab.interpret.heads.labels import LabelThresholds

_JS = r"""
(function(){
function recordError(msg){var p=document.createElement("pre");p.className="selftest-error";p.textContent=msg;
 document.body.appendChild(p);}
window.addEventListener("error",function(e){recordError(String(e.message));});
var D=JSON.parse(document.getElementById("atlas-data").textContent);
function fmt(v){return (v===null||v===undefined)?"n/a":Number(v).toPrecision(3);}
function select(l,h){
 document.querySelectorAll("td.sel").forEach(function(e){e.classList.remove("sel");});
 document.querySelectorAll('td[data-l="'+l+'"][data-h="'+h+'"]').forEach(function(e){e.classList.add("sel");});
 var parts=[]; Object.keys(D.scores).forEach(function(k){parts.push(k+"="+fmt(D.scores[k][l][h]));});
 var roles=(D.roles[l]&&D.roles[l][h])||[];
 var vs=[]; Object.keys(D.verdicts).forEach(function(k){var v=D.verdicts[k];
  v.heads.forEach(function(x){if(x[0]==l&&x[1]==h){vs.push(k+" check: "+v.verdict);}});});
 document.getElementById("focus").textContent="head "+l+"."+h+" (kv group "+D.kv_group[l][h]+"): "+parts.join(", ")+
  "; roles: "+(roles.length?roles.join(", "):"none")+(vs.length?"; gated in: "+vs.join(", "):"");
 document.body.dataset.focus=l+"."+h;
 drawEvidence(l,h);
}
var CELL=8;
function drawEvidence(l,h){
 var box=document.getElementById("evidence"); box.innerHTML="";
 (D.evidence[l+"."+h]||[]).forEach(function(ev){
  var n=ev.map.length, c=document.createElement("canvas"); c.width=n*CELL; c.height=n*CELL;
  c.dataset.kind=ev.kind; c.dataset.n=String(n); c.title=ev.kind+": rows = queries, columns = keys";
  var g=c.getContext("2d");
  for(var i=0;i<n;i++){for(var j=0;j<n;j++){var w=ev.map[i][j];
   g.fillStyle="rgb("+Math.round(255-225*w)+","+Math.round(255-165*w)+","+Math.round(255-60*w)+")";
   g.fillRect(j*CELL,i*CELL,CELL,CELL);}}
  var fig=document.createElement("figure"); fig.style.display="inline-block"; fig.appendChild(c);
  var cap=document.createElement("figcaption"); cap.className="note";
  cap.textContent=ev.kind+" evidence, head "+l+"."+h+": "+ev.tokens.slice(0,12).join(" ")+(n>12?" ...":"");
  fig.appendChild(cap); box.appendChild(fig);});
}
document.querySelectorAll("table.hm td[data-l]").forEach(function(td){
 var f=function(){select(td.dataset.l,td.dataset.h);}; td.addEventListener("click",f); td.addEventListener("mouseenter",f);});
var out_evidence=0;
function selftest(){
 var problems=[]; var want=0; D.kv_group.forEach(function(r){want+=r.length;});
 document.querySelectorAll("table.hm").forEach(function(t){
  var cells=t.querySelectorAll("td[data-l]");
  if(cells.length!==want){problems.push(t.dataset.grid+": "+cells.length+" cells, want "+want);}
  cells.forEach(function(c){if(!c.style.backgroundColor){problems.push(t.dataset.grid+": a cell without colour");}});});
 var grids=document.querySelectorAll("table.hm").length;
 if(grids!==Object.keys(D.scores).length+1){problems.push(grids+" grids, want "+(Object.keys(D.scores).length+1));}
 var first=document.querySelector('table[data-grid="roles"] td[data-l]');
 if(first){first.dispatchEvent(new MouseEvent("click",{bubbles:true}));
  if(document.body.dataset.focus!==first.dataset.l+"."+first.dataset.h){problems.push("click did not select the head");}
  var txt=document.getElementById("focus").textContent;
  Object.keys(D.scores).forEach(function(k){if(txt.indexOf(k+"=")<0){problems.push("focus lacks "+k);}});}
 var keys=Object.keys(D.evidence);
 if(keys.length){var lh=keys[0].split("."), cell=document.querySelector('table[data-grid="roles"] td[data-l="'+lh[0]+'"][data-h="'+lh[1]+'"]');
  cell.dispatchEvent(new MouseEvent("click",{bubbles:true}));
  var cs=document.querySelectorAll("#evidence canvas");
  if(cs.length!==D.evidence[keys[0]].length){problems.push("evidence: "+cs.length+" maps drawn, want "+D.evidence[keys[0]].length);}
  cs.forEach(function(c){if(c.width!==Number(c.dataset.n)*CELL){problems.push("evidence map of the wrong size");}
   var ev=D.evidence[keys[0]].filter(function(e){return e.kind===c.dataset.kind;})[0];
   var px=c.getContext("2d").getImageData(CELL/2,CELL/2,1,1).data, want=Math.round(255-225*ev.map[0][0]);
   if(Math.abs(px[0]-want)>2){problems.push("evidence map: first cell red "+px[0]+", want "+want);}});
  out_evidence=cs.length;}
 var rows=document.querySelectorAll("table.verdicts tr[data-kind]").length;
 if(rows!==Object.keys(D.verdicts).length){problems.push(rows+" verdict rows, want "+Object.keys(D.verdicts).length);}
 var out=document.createElement("pre"); out.id="selftest-result"; out.dataset.status=problems.length?"fail":"pass";
 out.dataset.checkedGrids=String(grids); out.dataset.checkedEvidence=String(out_evidence);
 out.textContent=problems.length?problems.join("\n"):"selftest pass"; document.body.appendChild(out);
}
if(location.hash==="#selftest"){try{selftest();}catch(e){recordError("selftest threw: "+e);}}
})();
"""


def _num(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


def _shade(v, lo, hi) -> str:
    if v is None:
        return "#eeeeee"
    t = 0.0 if hi == lo else max(0.0, min(1.0, (v - lo) / (hi - lo)))
    return f"rgb({int(250 - 220 * t)},{int(250 - 160 * t)},{int(255 - 60 * t)})"


def _strongest(a, layer: int, head: int) -> str | None:
    best, kind = 1.0, None
    for k in a.kinds:
        v, thr = _num(a.scores[k][layer, head]), a.thresholds.get(k)
        if v is not None and thr and v / thr >= best:
            best, kind = v / thr, k
    return kind


def _role_grid(a) -> str:
    head = "".join(f"<th>{h}</th>" for h in range(a.n_heads))
    groups = (
        "".join(f"<th class='note'>kv{int(g)}</th>" for g in a.kv_group[0].tolist()) if a.n_kv_heads < a.n_heads else ""
    )
    rows = []
    for layer in range(a.n_layers):
        cells = []
        for h in range(a.n_heads):
            main = _strongest(a, layer, h)
            letters = "".join(
                KINDS[k].letter
                for k in a.kinds
                if _num(a.scores[k][layer, h]) is not None
                and float(a.scores[k][layer, h]) >= a.thresholds.get(k, math.inf)
            )
            roles = a.roles(layer, h)
            tip = html.escape(f"{layer}.{h}: " + (", ".join(roles) if roles else "no role"), quote=True)
            colour = KINDS[main].colour if main else "#f4f4f4"
            fg = "#fff" if main else "#333"
            cells.append(
                f'<td data-l="{layer}" data-h="{h}" title="{tip}" style="background-color:{colour};'
                f'color:{fg};text-align:center;font-size:11px;min-width:22px">{letters}</td>'
            )
        rows.append(f"<tr><th>{layer}</th>{''.join(cells)}</tr>")
    extra = f"<tr><th></th>{groups}</tr>" if groups else ""
    legend = " ".join(
        f'<span style="background:{KINDS[k].colour};color:#fff;padding:0 4px">{KINDS[k].letter} '
        f"{html.escape(ROLE[k])}</span>"
        for k in a.kinds
    )
    return (
        f'<h2>Roles</h2><table class="hm" data-grid="roles"><tr><th></th>{head}</tr>{extra}{"".join(rows)}</table>'
        f"<div class='note'>layers down, query heads across; colour: the strongest role (score / threshold); "
        f"letters: every role. {legend}</div>{_pattern_note(a)}<div id='focus'></div><div id='evidence'></div>"
    )


def _pattern_note(a) -> str:
    """What the "(pattern)" roles are, beside the kinds of the same name."""
    if not a.labels:
        return ""
    t = LabelThresholds()
    return (
        "<div class='note'>roles marked (pattern) are the pattern labels of the first text piece "
        "(headlab.interpret.heads.labels), another measure than the kinds': previous-token, next-token and self "
        f"when at least {t.positional:g} of the rows have their largest weight at offset -1, +1 or 0 (the kind "
        "previous-token is the mean weight one step back, on random tokens), separator-sink at a mean "
        f"{t.sink:g} on the sinks, broad at a normalised entropy of {t.broad:g}.</div>"
    )


def _heatmap(name: str, grid) -> str:
    vals = [[_num(x) for x in r] for r in grid.tolist()]
    flat = [x for r in vals for x in r if x is not None]
    lo, hi = (min(flat), max(flat)) if flat else (0.0, 1.0)
    head = "".join(f"<th>{h}</th>" for h in range(len(vals[0])))
    rows = []
    for layer, r in enumerate(vals):
        cells = "".join(
            f'<td data-l="{layer}" data-h="{h}" title="{layer}.{h}: {"n/a" if v is None else f"{v:.4g}"}" '
            f'style="background-color:{_shade(v, lo, hi)}"></td>'
            for h, v in enumerate(r)
        )
        rows.append(f"<tr><th>{layer}</th>{cells}</tr>")
    return (
        f'<div><h3 style="font-size:14px">{html.escape(name)}</h3><table class="hm" data-grid="{html.escape(name)}">'
        f"<tr><th></th>{head}</tr>{''.join(rows)}</table><div class='note'>{lo:.3g} .. {hi:.3g}</div></div>"
    )


def _verdicts(a) -> str:
    if not a.verdicts:
        return "<h2>Causal checks</h2><p class='note'>not run</p>"
    rows = []
    for k, v in a.verdicts.items():
        lo, hi = v["targeted_ci"]
        times = "n/a" if v.get("times_random") is None else f"{v['times_random']:.1f}x"
        heads = ", ".join(f"{l}.{h}" for l, h in v["heads"])
        rows.append(
            f'<tr data-kind="{html.escape(k)}"><td>{html.escape(ROLE.get(k, k))}</td><td>{html.escape(v["task"])}</td>'
            f"<td>{html.escape(heads)}</td><td>{v['targeted']:.4g} [{lo:.4g}, {hi:.4g}]</td>"
            f"<td>{v['random_mean']:.4g} (max upper {v['random_max_upper']:.4g}, {len(v['random'])} draws)</td>"
            f"<td>{times}</td><td><b>{html.escape(v['verdict'])}</b></td></tr>"
        )
    rule = html.escape(next(iter(a.verdicts.values()))["rule"])
    return (
        "<h2>Causal checks</h2><table class='verdicts'><tr><th>kind</th><th>task</th><th>top-k gated</th>"
        "<th>effect [95% CI]</th><th>random draws</th><th>ratio</th><th>verdict</th></tr>"
        f"{''.join(rows)}</table><div class='note'>{rule}</div>"
    )


def _evidence(a) -> dict[str, list]:
    """``{"l.h": [{"kind", "tokens", "map"}, ...]}``: the page's evidence maps, by head."""
    out: dict[str, list] = {}
    for ev in a.evidence.values():
        out.setdefault(f"{ev['layer']}.{ev['head']}", []).append(
            {"kind": ev["kind"], "tokens": ev["tokens"], "map": ev["map"]}
        )
    return out


def render_page(a, *, title: str | None = None) -> str:
    """The whole page for one :class:`~headlab.interpret.atlas.result.Atlas` ``a``."""
    body = [
        _role_grid(a),
        "<h2>Scores</h2><div class='grids'>" + "".join(_heatmap(k, v) for k, v in a.scores.items()) + "</div>",
        _verdicts(a),
    ]
    if a.skipped:
        body.append(
            "<h2>Not run</h2><ul>"
            + "".join(f"<li>{html.escape(k)}: {html.escape(r)}</li>" for k, r in a.skipped.items())
            + "</ul>"
        )
    summary = [
        f"{a.model} ({a.family}{', causal' if a.causal else ''}): {a.n_layers} layers x {a.n_heads} heads"
        + (f" on {a.n_kv_heads} kv heads" if a.n_kv_heads < a.n_heads else "")
    ]
    for k, s in a.summary().items():
        summary.append(
            f"{ROLE[k]}: {s['count']} heads ({100 * s['share']:.1f}%) at >= {s['threshold']}"
            + (f"; check: {s['verdict']}" if s["verdict"] else "")
        )
    data = {
        "scores": {k: [[_num(x) for x in r] for r in v.tolist()] for k, v in a.scores.items()},
        "roles": [[a.roles(l, h) for h in range(a.n_heads)] for l in range(a.n_layers)],
        "kv_group": a.kv_group.tolist(),
        "verdicts": {k: {"verdict": v["verdict"], "heads": v["heads"]} for k, v in a.verdicts.items()},
        "evidence": _evidence(a),
    }
    return shell.page(
        title=title or f"head atlas: {a.model}",
        body="\n".join(body),
        summary_lines=summary,
        banner="; ".join(a.notes) if a.notes else None,
        data=data,
        data_id="atlas-data",
        script=_JS,
        generator="headlab atlas",
    )


__all__ = ["render_page"]
