"""How ``heads importance`` and ``heads ablate`` show their results: the ranking and the rank correlations, the
verdicts; ``--json`` prints the library's result document."""

from __future__ import annotations

from headlab.cli.views import view
from headlab.results import print_json


def _as_json(outcome) -> bool:
    if outcome.ctx.options["as_json"]:
        print_json(outcome.result.native.to_json())
        return True
    return False


@view("heads-importance")
def show_importance(ctx, outcome, console, err) -> None:
    if _as_json(outcome):
        return
    r = outcome.result.native
    rank = r.ranking()
    console.print(
        f"{r.model}: importance ({r.loss} loss) of {len(rank)} heads over {r.n_examples} examples, {r.seconds:.1f} s",
        highlight=False,
        soft_wrap=True,
    )
    console.print("least important: " + ", ".join(f"{l}.{h}" for l, h in rank[:8]), highlight=False)
    console.print("most important:  " + ", ".join(f"{l}.{h}" for l, h in rank[::-1][:8]), highlight=False)
    for k, v in r.correlations.items():
        console.print(f"Spearman {k}: {'n/a' if v is None else f'{v:.3f}'}", highlight=False)
    if outcome.files:
        out = outcome.path.parent
        console.print(f"wrote {out}/importance.json, {out}/heads.html", highlight=False, soft_wrap=True)


@view("heads-ablate")
def show_ablation(ctx, outcome, console, err) -> None:
    if _as_json(outcome):
        return
    r = outcome.result.native
    console.print(
        f"{r.model}: {r.kind} ablation, {r.loss} loss {r.baseline:.4g} unablated, {r.n_examples} "
        f"examples; threshold {r.threshold:.3g} (noise floor {r.floor_text()})",
        highlight=False,
        soft_wrap=True,
    )
    console.print("verdicts: " + ", ".join(f"{n} {c}" for c, n in r.counts().items()), highlight=False)
    for note in r.notes[1:]:  # the first says what the effects are; the others are cautions
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    for v in r.verdicts:
        if v.verdict == "redundant":
            console.print(f"  {v.layer}.{v.head} {v.label()}: {v.evidence}", highlight=False, soft_wrap=True)
    if outcome.files:
        out = outcome.path.parent
        console.print(f"wrote {out}/ablation.json, {out}/heads.html", highlight=False, soft_wrap=True)
