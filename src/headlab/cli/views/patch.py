"""How ``headlab patch`` shows its result: the clean and corrupted metric, each method's top heads (or layers) per
site kind, the agreement of attribution with exact patching, and the file written; ``--json``: the document."""

from __future__ import annotations

from headlab.cli.views import view
from headlab.results import print_json


@view("patch")
def show(ctx, outcome, console, err) -> None:
    from headlab.interpret.patching.runs import RESID_KINDS

    run, o = outcome.result.native, ctx.options
    if o["as_json"]:
        print_json(run.doc)
        return
    main = run.main
    console.print(
        f"{main.model}: logit diff {o['answer']!r} - {o['wrong']!r}: clean {main.clean:.3f}, corrupted "
        f"{main.corrupted:.3f}",
        highlight=False,
        soft_wrap=True,
    )
    for name, r in run.results.items():
        for kind in run.kinds:
            per_layer = kind in RESID_KINDS  # one value per layer
            console.print(
                f"{name} patching, {kind}: top {'layers (layer' if per_layer else 'heads (layer.head'} effect)",
                highlight=False,
            )
            console.print(
                "  " + ", ".join(f"{l}{'' if per_layer else f'.{h}'} {e:+.3f}" for l, h, e in r.top(o["top"], kind)),
                highlight=False,
                soft_wrap=True,
            )
    for kind, c in run.doc.get("agreement", {}).items():
        sp = "n/a" if c["spearman"] is None else f"{c['spearman']:.3f}"
        console.print(
            f"attribution vs exact ({kind}): Spearman {sp}, top-10 overlap "
            f"{c['top10_overlap']}/{min(10, c['n'])}, {c.get('time_ratio', float('nan')):.1f}x faster",
            highlight=False,
        )
    if outcome.files:
        console.print(f"wrote {o['out']}", highlight=False)
