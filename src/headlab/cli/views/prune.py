"""How ``heads prune`` shows its result: where the pruned model went, its heads per layer, the notes, and the
curve's summary; ``--json`` prints the summary."""

from __future__ import annotations

from headlab.cli.views import view
from headlab.results import print_json


@view("heads-prune")
def show_prune(ctx, outcome, console, err) -> None:
    summary = outcome.result.figures
    if ctx.options["as_json"]:
        print_json(summary)
        return
    console.print(
        f"saved the pruned model to {summary['out']}/ (heads per layer {summary['heads_per_layer']})",
        highlight=False,
        soft_wrap=True,
    )
    for n in summary["notes"]:
        console.print(f"[yellow]note:[/] {n}", highlight=False, soft_wrap=True)
    if "curve" in summary:
        console.print(summary["curve"], highlight=False, soft_wrap=True)
