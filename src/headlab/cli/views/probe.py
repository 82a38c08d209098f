"""How ``headlab probe`` shows its result: the model and treebank line, the best head of each relation and direction
against its fixed-offset baseline, the notes and the files written; ``--json``: the best heads as JSON."""

from __future__ import annotations

from headlab.cli.views import view
from headlab.results import print_json


@view("probe")
def show(ctx, outcome, console, err) -> None:
    r = outcome.result.native
    if ctx.options["as_json"]:
        print_json(r.summary())
        return
    console.print(
        f"{r.model} ({r.family}{', causal' if r.causal else ''}): {r.sentences} sentences, {r.tokens} "
        f"tokens, {len(r.skipped)} skipped, {r.seconds:.1f} s",
        highlight=False,
        soft_wrap=True,
    )
    console.print(
        f"{'relation':<14} {'direction':<10} {'head':>6} {'acc %':>6} {'offset':>6} {'base %':>6} {'count':>6}",
        highlight=False,
    )
    for b in r.best_heads:
        if b.count < r.min_count:
            continue
        mark = "*" if b.margin > 0 else " "
        console.print(
            f"{b.relation:<14} {b.direction:<10} {f'{b.layer}-{b.head}':>6} {100 * b.accuracy:6.1f} "
            f"{b.baseline_offset:+6d} {100 * b.baseline_accuracy:6.1f} {b.count:6d} {mark}",
            highlight=False,
        )
    for note in r.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    if outcome.files:
        console.print(f"[bold]wrote:[/] {', '.join(str(f) for f in outcome.files)}", highlight=False, soft_wrap=True)
