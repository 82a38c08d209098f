"""``headlab demo``: the main job on a default sentence with the default model (``make demo``)."""

from __future__ import annotations

from pathlib import Path

import typer

from headlab.cli.app import app, console

DEMO_TEXT = (
    "The model reads the sentence once, and each head decides which earlier or later words "
    "matter for the word it is looking at."
)


@app.command()
def demo(
    out: Path = typer.Option(Path("headlab-report"), "--out", "-o", help="report folder"),
    model: str = typer.Option("minilm", "--model", "-m", help="a known model name or a local model folder"),
) -> None:
    """Analyse a default sentence with the bundled default model (all-MiniLM-L6-v2) and write the report.

    Runs `headlab analyze` with --force: a previous report in the folder is replaced (other files are kept).
    """
    from headlab.cli.views.analyze import render_summary
    from headlab.interpret.report.analyze_job import analyze
    from headlab.models.loader import model_path

    model_path(model)  # an unknown name or folder: one line, before anything is said or written
    console.print(f"headlab demo: analysing {DEMO_TEXT!r} with {model}", highlight=False, soft_wrap=True)
    r = analyze(DEMO_TEXT, model=model, out_dir=out, force=True, progress=True)
    render_summary(r, console)
    console.print(f"open {r.html.resolve()} in a browser", highlight=False, soft_wrap=True)
