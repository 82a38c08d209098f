"""A self-contained HTML page for one explanation: tokens shaded per method, side by side, and agreement.

No external file, font or script: inline CSS and one small inline script. Each method is a panel
with the text's tokens, each token's background the score scaled by the method's largest |score|
(red = supports the explained output, blue = against; attention, gradient and leave-one-out are
never negative); special tokens are grey and unshaded. Under the panels, the Kendall tau (and
Spearman) matrix between methods. Opened with ``#selftest`` the page checks its own shading (the
highest-ranked token of each panel is the most opaque one) and writes ``selftest: pass`` or the
failure into ``#selftest``.
"""

from __future__ import annotations

import html
from pathlib import Path

from headlab.interpret import shell
from headlab.interpret.saliency.figures import normalised
from headlab.results import write_json

_JS = """
(function(){
  if (location.hash !== '#selftest') return;
  var out = document.getElementById('selftest'), problems = [];
  try {
    var panels = document.querySelectorAll('.panel');
    if (panels.length !== %(n)d) problems.push('panels ' + panels.length + ' != %(n)d');
    panels.forEach(function(p){
      var best = null, bestA = -1, top = p.getAttribute('data-top');
      p.querySelectorAll('.tok:not(.special)').forEach(function(t){
        var m = getComputedStyle(t).backgroundColor.match(/rgba?\\(([^)]+)\\)/);
        var parts = m ? m[1].split(',') : [];
        var a = parts.length > 3 ? parseFloat(parts[3]) : (parts.length ? 1 : 0);
        if (a > bestA) { bestA = a; best = t.getAttribute('data-i'); }
      });
      if (top !== null && best !== top) problems.push(p.getAttribute('data-method') + ': most opaque token ' + best + ' != top ' + top);
    });
  } catch (e) { problems.push('error ' + e); }
  out.textContent = problems.length ? 'selftest: fail: ' + problems.join('; ') : 'selftest: pass';
})();
"""


def _colour(v: float) -> str:
    r, g, b = (200, 30, 30) if v >= 0 else (30, 80, 200)
    return f"rgba({r},{g},{b},{min(1.0, abs(v)):.3f})"


def explanation_fragment(ex) -> str:
    """The method panels (tokens shaded) and the agreement table, without a page around them: the body of
    :func:`render_explanation_html`, and what ``headlab analyze`` embeds in its report (the same classes:
    ``.panel``, ``.tok``)."""
    keep = ex.keep()
    panels = []
    for m in ex.methods:
        norm = normalised(ex.scores[m], keep)
        ranked = ex.ranking(m, magnitude=True)
        toks = []
        for i, (t, s) in enumerate(zip(ex.tokens, ex.special)):
            title = f"{t}: {ex.scores[m][i]:.4g}"
            if s:
                toks.append(
                    f'<span class="tok special" data-i="{i}" title="{html.escape(title)}">{html.escape(t)}</span>'
                )
            else:
                toks.append(
                    f'<span class="tok" data-i="{i}" style="background:{_colour(norm[i])}" '
                    f'title="{html.escape(title)}">{html.escape(t)}</span>'
                )
        top = f' data-top="{ranked[0]}"' if ranked else ""
        panels.append(f'<div class="panel" data-method="{m}"{top}><h2>{m}</h2>{"".join(toks)}</div>')
    agr_html = ""
    if len(ex.methods) > 1:
        agr = ex.agreement()
        head = "".join(f"<th>{m}</th>" for m in ex.methods)
        rows = []
        for a in ex.methods:
            cells = []
            for b in ex.methods:
                if a == b:
                    cells.append("<td>1</td>")
                    continue
                p = agr[a, b]
                tau = "-" if p.kendall_tau != p.kendall_tau else f"{p.kendall_tau:.2f}"
                pv = "" if p.kendall_p != p.kendall_p else f" (p {p.kendall_p:.2g})"
                cells.append(f"<td>{tau}{pv}</td>")
            rows.append(f"<tr><th>{a}</th>{''.join(cells)}</tr>")
        agr_html = (
            f"<h2>Agreement: Kendall tau (p) over |scores| of the {agr.pairs and next(iter(agr.pairs.values())).n} "
            f"non-special tokens</h2><table class='agreement'><tr><th></th>{head}</tr>{''.join(rows)}</table>"
        )
    return f"<div class='panels'>{''.join(panels)}</div>{agr_html}"


def render_explanation_html(ex) -> str:
    """The page for an :class:`~headlab.interpret.saliency.explanation.Explanation` (a string)."""
    what = (
        f"class {html.escape(str(ex.target_label or ex.target))} (logit {ex.y:.4g})"
        if ex.kind == "classifier"
        else f"next token {ex.target} (logit {ex.y:.4g})"
        if ex.kind == "next_token"
        else f"cosine similarity {ex.y:.4g}"
    )
    probs = "" if ex.probs is None else " &middot; probabilities " + ", ".join(f"{p:.3f}" for p in ex.probs)
    gap = "" if ex.completeness_gap is None else f" &middot; IG completeness gap {100 * ex.completeness_gap:.3f}%"
    notes = "".join(f'<p class="note warn">{html.escape(n)}</p>' for n in ex.notes)
    body = (
        f"<p class='hint'>explaining {what}{probs}{gap} &middot; backend {html.escape(ex.backend)}</p>{notes}"
        f"{explanation_fragment(ex)}<pre id='selftest'></pre>"
    )
    return shell.page(
        title=ex.text,
        body=body,
        data={"tokens": ex.tokens, "scores": ex.scores},
        data_id="data",
        script=_JS % {"n": len(ex.methods)},
        generator="headlab explain",
    )


def write_explanation(ex, out_dir: str | Path) -> dict[str, Path]:
    """Write ``explanation.html``, ``explanation.png`` and ``explanation.json`` into ``out_dir`` (created)."""
    from headlab.interpret.saliency.figures import explanation_png

    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = {"html": out / "explanation.html", "png": out / "explanation.png", "json": out / "explanation.json"}
    paths["html"].write_text(render_explanation_html(ex), encoding="utf-8")
    explanation_png(ex, paths["png"])
    write_json(paths["json"], ex.to_json(heads=True), indent=None)
    return paths
