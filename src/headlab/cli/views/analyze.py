"""``headlab analyze``'s view (and ``headlab demo``'s): where the report's files are, the mode, and the clearest
head of each pattern; ``--json`` prints that summary as JSON."""

from __future__ import annotations

from headlab.cli.views import view
from headlab.results import print_json


@view("analyze")
def show(ctx, outcome, console, err) -> None:
    r = outcome.result.native
    if ctx.options["as_json"]:
        print_json(summary_json(r))
        return
    render_summary(r, console)


def render_summary(r, console) -> None:
    """Where the files are, the mode, and the clearest head of each pattern (``r``: a
    :class:`~headlab.interpret.report.analyze_job.ReportResult`; ``console``: a rich console)."""
    from headlab.interpret.report.selection import heads_text

    def line(text: str) -> None:
        console.print(text, highlight=False, soft_wrap=True)

    line(f"[bold]report:[/] {r.out_dir}/")
    line(f"  {r.html.name:<24} interactive page: pick a head, hover tokens (open in a browser)")
    line(f"  {r.csv.name + ', ' + r.json.name:<24} per-head table ({len(r.records)} heads)")
    if r.pngs:
        span = r.pngs[0].name if len(r.pngs) == 1 else f"{r.pngs[0].name} .. {r.pngs[-1].name}"
        line(f"  {span:<24} attention maps, one picture per layer")
    line(
        f"{r.model} ({r.family}): {len(r.tokens)} tokens, {r.n_layers} layers x {heads_text(r.layer_heads)} heads, "
        f"mode {r.mode}"
    )
    for note in r.notes:
        line(f"[yellow]note:[/] {note}")
    found = r.interesting()
    if found:
        console.print("heads to look at first:", soft_wrap=True)
        for label, rec in found:
            ev = next((e for e in rec.evidence if e.startswith(label)), "")
            line(f"  {rec.layer}.{rec.head:<3} {ev}")
    else:
        console.print("no head passes a pattern threshold on this text (see heads.csv for the numbers)", soft_wrap=True)


def summary_json(r) -> dict:
    """The ``--json`` summary: where the files are, the mode, the drawn heads, the notes, the clearest heads."""
    return {
        "out_dir": r.out_dir,
        "html": r.html,
        "csv": r.csv,
        "json": r.json,
        "pngs": r.pngs,
        "mode": r.mode,
        "tokens": len(r.tokens),
        "drawn": [f"{a}.{b}" for a, b in r.drawn],
        "notes": r.notes,
        "interesting": {lab: f"{x.layer}.{x.head}" for lab, x in r.interesting()},
    }


__all__ = ["render_summary", "show", "summary_json"]
