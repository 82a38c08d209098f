"""``headlab circuit``'s view: the task and its metric, the edge scores, the circuit and its top edges, the
faithfulness areas and the files written (``--json``: the study's envelope instead)."""

from __future__ import annotations

from headlab.cli.views import view
from headlab.results import print_json


@view("circuit")
def show(ctx, outcome, console, err) -> None:
    from headlab.interpret.instruments.circuit import result_json

    o = ctx.options
    if o["as_json"]:
        print_json(outcome.result.to_json())
        return
    v = outcome.result.native
    s, c, f = v["scores"], v["circuit"], v["faithfulness"]
    p = ctx.state["pairs"]
    say = lambda line: console.print(line, highlight=False, soft_wrap=True)
    say(
        f"{c.model}: task {o['task']}, {len(p)} pairs, metric {s.metric}: clean {s.clean:.4g}, corrupted "
        f"{s.corrupted:.4g}"
    )
    how = f"{s.method}" + (f" ({s.steps} steps)" if s.method == "eap-ig" else "")
    say(
        f"edge scores: {how}, {len(s.edges):,} edges, {s.seconds:.1f} s"
        + (f" (read from {o['scores']})" if o["scores"] is not None else "")
    )
    chosen = c.settings.get("chosen")
    pruned = f" ({chosen:,} chosen, pruned to those on a path)" if chosen not in (None, c.n_edges) else ""
    say(
        f"circuit ({c.method}): {c.n_edges:,} edges{pruned}, {100 * c.n_edges / c.n_graph_edges:.3g}% of "
        f"{c.n_graph_edges:,}; {len(c.nodes)} nodes; ablation {c.ablation}: metric with the circuit alone "
        f"{_g(c.circuit_metric)}, with every edge ablated {_g(c.empty)}"
        + ("" if c.faithfulness is None else f"; f = {c.faithfulness:.3f}")
    )
    mine = set(c.edges)
    top = sorted(((e, x) for e, x in c.scores.items() if e in mine and x == x), key=lambda t: -abs(t[1]))
    say(f"top edges of the circuit ({'growth of the criterion' if c.method == 'acdc' else 'score'}):")
    for e, x in top[: o["top"]]:
        say(f"  {e:<28} {x:+.4g}")
    if f is not None:
        d = result_json(f)
        parts = [f"{k.upper()} {d[k]:.3f}" for k in ("cpr", "cmd") if isinstance(d.get(k), (int, float))]
        say(
            "faithfulness: "
            + (", ".join(parts) if parts else "measured")
            + " (CPR: area under f over sizes, higher is better; CMD: area between f and 1, lower is better)"
        )
    if outcome.files:
        say("wrote: " + ", ".join(str(x) for x in outcome.files))


def _g(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"
