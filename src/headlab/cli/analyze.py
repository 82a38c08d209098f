"""``headlab analyze "TEXT"``: every attention head of a model on a text, as a report folder."""

from __future__ import annotations

from pathlib import Path

import typer

from headlab.cli.app import app, check_heads_before_loading, check_utf8, console, print_json
from headlab.errors import InputError
from headlab.interpret.report.annotations import study_annotations
from headlab.interpret.report.analyze_job import MAX_FULL_TOKENS, ReportResult, heads_text
from headlab.interpret.report.analyze_job import analyze as run_analyze


def render_summary(r: ReportResult) -> None:
    """Where the files are, the mode, and the clearest head of each pattern."""
    console.print(f"[bold]report:[/] {r.out_dir}/", highlight=False, soft_wrap=True)
    console.print(f"  {r.html.name:<24} interactive page: pick a head, hover tokens (open in a browser)", highlight=False, soft_wrap=True)
    console.print(f"  {r.csv.name + ', ' + r.json.name:<24} per-head table ({len(r.records)} heads)", highlight=False, soft_wrap=True)
    if r.pngs:
        span = r.pngs[0].name if len(r.pngs) == 1 else f"{r.pngs[0].name} .. {r.pngs[-1].name}"
        console.print(f"  {span:<24} attention maps, one picture per layer", highlight=False, soft_wrap=True)
    console.print(f"{r.model} ({r.family}): {len(r.tokens)} tokens, {r.n_layers} layers x {heads_text(r.layer_heads)} heads, "
                  f"mode {r.mode}", highlight=False, soft_wrap=True)
    for note in r.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    found = r.interesting()
    if found:
        console.print("heads to look at first:", soft_wrap=True)
        for label, rec in found:
            ev = next((e for e in rec.evidence if e.startswith(label)), "")
            console.print(f"  {rec.layer}.{rec.head:<3} {ev}", highlight=False, soft_wrap=True)
    else:
        console.print("no head passes a pattern threshold on this text (see heads.csv for the numbers)", soft_wrap=True)


@app.command("analyze")
def analyze_cmd(
    text: str = typer.Argument(..., help="the text to analyse (quote it)"),
    model: str = typer.Option("minilm", "--model", "-m", help="a known model name (minilm) or a local model folder"),
    out: Path = typer.Option(Path("headlab-report"), "--out", "-o", help="report folder (must be new or empty)"),
    backend: str = typer.Option(None, "--backend", help="attention backend the model runs on (headlab backends)"),
    force: bool = typer.Option(False, "--force", help="write into a non-empty folder, replacing a previous report"),
    heads: str = typer.Option(None, "--heads", help="heads to draw for long inputs, LAYER.HEAD,... e.g. 0.3,2.5"),
    max_full_tokens: int = typer.Option(MAX_FULL_TOKENS, "--max-full-tokens",
                                        help="longer inputs use streaming statistics and draw only chosen heads"),
    truncate: bool = typer.Option(False, "--truncate", help="cut text longer than the model's positions (warned)"),
    probe: Path = typer.Option(None, "--probe", help="label heads with a `headlab probe` result (relations.json)"),
    heads_result: Path = typer.Option(None, "--heads-result",
                                      help="show importance and verdicts from `headlab heads` (importance.json, ablation.json)"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    flow: bool = typer.Option(False, "--flow", help="also write the norm maps and the rollout beside the page "
                                                      "(norms_layer_*.png, rollout.png, rollout.json); the page always shows them"),
) -> None:
    """Write a report on every attention head: per-layer pictures, an interactive page, a per-head table.

    Example: headlab analyze "The cat sat on the mat because it was tired." --out cat-report

    TEXT must be valid UTF-8: other bytes (Latin-1 text, say) are refused with their position.
    """
    check_utf8(text)
    notes = study_annotations(probe=probe, heads=heads_result)  # read before any model work
    check_heads_before_loading(model, heads)
    r = run_analyze(text, model=model, out_dir=out, backend=backend, force=force, heads=heads,
                    max_full_tokens=max_full_tokens, truncate=truncate, progress=True,  # each step on stderr
                    annotations=notes or None, flow=flow)
    if as_json:
        print_json({"out_dir": r.out_dir, "html": r.html, "csv": r.csv, "json": r.json, "pngs": r.pngs,
                    "mode": r.mode, "tokens": len(r.tokens), "drawn": [f"{a}.{b}" for a, b in r.drawn],
                    "notes": r.notes, "interesting": {lab: f"{x.layer}.{x.head}" for lab, x in r.interesting()}})
        return
    render_summary(r)
