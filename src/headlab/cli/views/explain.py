"""``headlab explain``'s view: one explanation (a token x method table, IG's gap, the agreement, the notes) or the
corpus study's tables, on the terminal; ``--json`` prints the result instead."""

from __future__ import annotations

from headlab.cli.views import view
from headlab.results import print_json

SHORT = {
    "attention": "attention",
    "gradient": "gradient",
    "grad_x_input": "grad*input",
    "integrated_gradients": "IG",
    "leave_one_out": "LOO",
    "rollout": "rollout",
    "norm_rollout": "norm roll",
    "attention_flow": "flow",
    "attention_norm": "norm",
}  # the column heads of the terminal tables


@view("explain")
def show(ctx, outcome, console, err) -> None:
    r, o = outcome.result.native, ctx.options
    if o["as_json"]:
        if o["dataset"] is None:
            j = r.to_json()
            doc = {k: j[k] for k in ("tokens", "target", "probs", "scores", "agreement", "completeness_gap")} | {
                "special": j["special"],
                "kind": j["kind"],
                "notes": j["notes"],
                "files": {k: str(v) for k, v in ctx.state.get("paths", {}).items()},
            }
        else:
            doc = r.to_json()
        print_json(doc)
        return
    if o["dataset"] is not None:
        render_study(r, console)
        return
    render_explanation(r, console)
    paths = ctx.state.get("paths")
    if paths:
        err.print(f"wrote {paths['html']} and {paths['png'].name}", highlight=False, soft_wrap=True)


def render_explanation(ex, console) -> None:
    """One explanation on the terminal: the target, a token x method table, IG's gap, the agreement, notes."""
    from rich.table import Table

    from headlab.interpret.saliency.tables import fmt

    what = {
        "classifier": f"class {ex.target}" + (f" ({ex.target_label})" if ex.target_label else ""),
        "next_token": f"next token id {ex.target}",
        "similarity": "cosine similarity",
    }[ex.kind]
    console.print(
        f"explaining {what}: y = {ex.y:.4g}"
        + ("" if ex.probs is None else "  probs " + ", ".join(f"{p:.3f}" for p in ex.probs)),
        highlight=False,
        soft_wrap=True,
    )
    t = Table(show_edge=False)
    t.add_column("#", justify="right")
    t.add_column("token")
    for m in ex.methods:
        t.add_column(SHORT[m], justify="right")
    for i, tok in enumerate(ex.tokens):
        style = "dim" if ex.special[i] else None
        t.add_row(str(i), tok, *(f"{ex.scores[m][i]:.4g}" for m in ex.methods), style=style)
    console.print(t)
    if ex.completeness_gap is not None:
        console.print(
            f"IG completeness gap: {100 * ex.completeness_gap:.3f}% of y(x) - y(baseline) = "
            f"{ex.y - ex.y_baseline:.4g} ({ex.ig_steps} steps)",
            highlight=False,
        )
    if len(ex.methods) > 1:
        agr = ex.agreement()
        a = Table(title="Kendall tau over |scores|, special tokens excluded (* p < 0.05)", show_edge=False)
        a.add_column("")
        for m in ex.methods:
            a.add_column(SHORT[m], justify="right")
        for x in ex.methods:
            cells = []
            for y in ex.methods:
                p = agr[x, y] if x != y else None
                star = "*" if p is not None and p.kendall_p == p.kendall_p and p.kendall_p < 0.05 else ""
                cells.append("1" if p is None else f"{fmt(p.kendall_tau, 2)}{star}")
            a.add_row(SHORT[x], *cells)
        console.print(a)
    for n in ex.notes:
        console.print(f"[yellow]note:[/] {n}", highlight=False, soft_wrap=True)


def render_study(r, console) -> None:
    """The corpus tables on the terminal: Kendall tau per method, the permutation test, the adversarial search,
    ERASER faithfulness, and what was skipped."""
    from rich.table import Table

    from headlab.interpret.saliency.tables import fmt, fmt_ci

    tb = r.tables
    console.print(
        f"{tb['n']} instances -> {r.out}/ ({', '.join(r.files)})"
        + (f"; accuracy {tb['accuracy']:.4f}" if "accuracy" in tb else ""),
        highlight=False,
        soft_wrap=True,
    )
    if tb.get("kendall"):
        t = Table(title="Kendall tau of attention with each method (per instance)", show_edge=False)
        for c in (
            "method",
            "mean",
            "std",
            "median",
            "significant",
            *[f"mean | pred {k}" for k in next(iter(tb["kendall"].values()))["by_class"]],
        ):
            t.add_column(c, justify="right")
        for m, d in tb["kendall"].items():
            t.add_row(
                m,
                fmt(d.get("mean")),
                fmt(d.get("std")),
                fmt(d.get("q50")),
                fmt(d.get("significant")),
                *(fmt(c.get("mean")) for c in d["by_class"].values()),
            )
        console.print(t)
    if tb.get("permutation"):
        p = tb["permutation"]
        t = Table(title="permutation test: median output TVD over 100 permutations", show_edge=False)
        for c in ("max attention", "instances", "median TVD"):
            t.add_column(c, justify="right")
        for b in p["bins"]:
            t.add_row(f"{b['max_attention'][0]:.2f}-{b['max_attention'][1]:.2f}", str(b["n"]), fmt(b["median_tvd"], 4))
        console.print(t)
    if tb.get("adversarial"):
        a = tb["adversarial"]
        console.print(
            f"adversarial attention (output TVD <= {a['tvd_budget']}): max JSD mean {fmt(a['max_jsd'].get('mean'))}, "
            f"median {fmt(a['max_jsd'].get('q50'))}, share > 0.5: {fmt(a['share_above_0.5'])}",
            highlight=False,
        )
    if tb.get("faithfulness"):
        t = Table(
            title="ERASER faithfulness: mean [95% bootstrap CI]; comprehensiveness up, sufficiency down",
            show_edge=False,
        )
        cols = [c for c in next(iter(tb["faithfulness"].values()))]
        t.add_column("method")
        for c in cols:
            t.add_column(c.replace("comprehensiveness", "comp").replace("sufficiency", "suff"), justify="right")
        for m, d in tb["faithfulness"].items():
            t.add_row(m, *(fmt_ci(d[c]) for c in cols))
        console.print(t)
    for s in r.skipped:
        console.print(f"[yellow]skipped:[/] {s}", highlight=False, soft_wrap=True)


__all__ = ["SHORT", "render_explanation", "render_study", "show"]
