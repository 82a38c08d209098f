"""``headlab atlas`` on the terminal: one line per kind (its heads, its share, the check's verdict and how many
times random), the kinds not run with the reason, and the files written; ``--json``: the summary as JSON."""

from __future__ import annotations

from headlab.cli.views import view
from headlab.results import print_json


@view("atlas")
def show(ctx, outcome, console, err) -> None:
    a = outcome.result.native
    if ctx.options["as_json"]:
        print_json(a.summary())
        return
    console.print(
        f"{a.model} ({a.family}): {a.n_layers} layers x {a.n_heads} heads; {sum(a.seconds.values()):.1f} s",
        highlight=False,
        soft_wrap=True,
    )
    console.print(
        f"{'kind':<16} {'heads':>5} {'share':>6}  {'check':<14} {'x random':>8}  heads with the role",
        highlight=False,
    )
    for kind, s in a.summary().items():
        v = a.verdicts.get(kind)
        times = "" if v is None or v["times_random"] is None else f"{v['times_random']:.1f}"
        console.print(
            f"{kind:<16} {s['count']:>5} {100 * s['share']:5.1f}%  {(s['verdict'] or '-'):<14} "
            f"{times:>8}  {', '.join(s['heads'][:8]) or '-'}",
            highlight=False,
            soft_wrap=True,
        )
    for k, r in a.skipped.items():  # in the CLI's names
        r = r.replace("treebank=FILE.conllu", "--treebank FILE.conllu")
        console.print(f"[yellow]not run:[/] {k}: {r}", highlight=False, soft_wrap=True)
    if outcome.files:
        console.print(f"[bold]wrote:[/] {outcome.files[0]}, {outcome.files[1]}", highlight=False, soft_wrap=True)


__all__ = ["show"]
