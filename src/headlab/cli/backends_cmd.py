"""``headlab backends``: the attention backends and what each supports."""

from __future__ import annotations

import typer
from rich.table import Table

import headlab
from headlab.cli.app import app, console, print_json


@app.command("backends")
def list_backends(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """List attention backends with their capabilities, in the order backend='auto' prefers them."""
    rows = headlab.backends()
    if as_json:
        print_json(rows)
        return
    t = Table(title="attention backends (auto prefers the first exact one that supports a call)")
    cols = ["name", "exact", "materializes", "returns_weights", "causal", "bool_mask", "mask_fn", "gqa",
            "dropout", "grad", "dtypes", "summary"]
    for c in cols:
        t.add_column(c.replace("_", " "))

    def cell(v):
        if isinstance(v, bool):
            return "[green]yes[/]" if v else "[red]no[/]"
        if isinstance(v, list):
            return ", ".join(v)
        return str(v)

    for r in rows:
        t.add_row(*(cell(r[c]) for c in cols))
    console.print(t)
