"""``headlab models``: the model families headlab adapts and what each step does for each (the support table)."""

from __future__ import annotations

import typer
from rich.table import Table

from headlab.cli.app import app, console, print_json


@app.command("models")
def list_models(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """List the Hugging Face families headlab adapts, their model types, and per step what is supported."""
    import headlab.models.hf  # noqa: F401  (registers the families)
    from headlab.models.hf.support import STEPS, support_rows

    rows = support_rows()
    if as_json:
        print_json(rows)
        return
    t = Table(title="model families (a step marked yes: works; a caveat follows the colon)")
    for col in ("family", "model types", "positions", "norms", *STEPS):
        t.add_column(col)
    for r in rows:
        if r["family"] is None:
            continue
        t.add_row(r["family"], ", ".join(r["model_types"]), r["positions"], r["norm_layout"],
                  *(r[s].replace("yes: ", "yes*: ") for s in STEPS))
    console.print(t)
    for r in rows:
        if r["family"] is None:
            console.print(f"[red]refused[/] {r['model_types'][0]}: {r['refused']}", highlight=False)
    console.print("To add a family: docs/adding-a-family.md", highlight=False)
