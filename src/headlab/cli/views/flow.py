"""``headlab flow``'s view: the ranked tokens of each row (rollout), of the flow from the source token, or the
first and last token's share per layer (norms); ``--json`` prints the result instead."""

from __future__ import annotations

from headlab.cli.views import view
from headlab.results import print_json


@view("flow")
def show(ctx, outcome, console, err) -> None:
    from rich.table import Table

    from headlab.interpret.flow.views import key_shares, ranked
    from headlab.interpret.instruments.flow import MODES

    if outcome.files:
        err.print(f"wrote {outcome.files[0]}", highlight=False)
    o, res = ctx.options, outcome.result.native
    if o["as_json"]:
        print_json(res.to_json())
        return
    method, top = o["method"], o["top"]
    if method in ("rollout", "norm-rollout"):
        shown = res.rows if res.rows is not None else res.maps[-1][:1]
        labels = res.row_positions if res.row_positions is not None else [0]
        for p, v in zip(labels, shown):
            console.print(
                _table(
                    f"{method} through layer {res.layer}, row {p} ({res.tokens[p] if res.tokens else p})",
                    ranked(v, res.tokens, top),
                )
            )
    elif method == "flow":
        console.print(
            _table(
                f"flow from token {res.source} at layer {res.layer} ({res.solver}, "
                f"{res.seconds:.2f} s, gap {res.gap:.1e})",
                ranked(res.flow, res.tokens, top),
            )
        )
    else:
        t = Table(
            title=f"share on the first / last token per layer ({o['mode'] or MODES[0]} norms, mean of heads "
            "and queries)",
            title_justify="left",
        )
        for h in ("layer", "weight first", "norm first", "weight last", "norm last"):
            t.add_column(h)
        for l, s in res.summaries.items():
            ks = key_shares(s)
            t.add_row(str(l), *(f"{v:.3f}" for v in (ks["weight"][0], ks["norm"][0], ks["weight"][1], ks["norm"][1])))
        console.print(t)


def _table(title: str, rows, header=("pos", "token", "value")):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for h in header:
        t.add_column(h)
    for r in rows:
        t.add_row(*(f"{x:.4f}" if isinstance(x, float) else str(x) for x in r))
    return t


__all__ = ["show"]
