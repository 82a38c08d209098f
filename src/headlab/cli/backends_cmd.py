"""``headlab backends``: the attention backends and what each supports."""

from __future__ import annotations

import typer
from rich.table import Table

from headlab.cli.app import app, console, print_json


@app.command("backends")
def list_backends(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """List attention backends with their capabilities, in the order backend='auto' prefers them."""
    from headlab.attention.core import backends as registered_backends

    rows = registered_backends()
    if as_json:
        print_json(rows)
        return
    # one column per backend, one row per capability: stays readable as backends are added
    t = Table(title="attention backends (auto uses the first exact one, left to right, that supports a call)")
    t.add_column("capability")
    for r in rows:
        t.add_column(r["name"], justify="center")
    caps = [
        "exact",
        "materializes",
        "returns_weights",
        "returns_lse",
        "causal",
        "bool_mask",
        "additive_mask",
        "mask_fn",
        "score_mod",
        "gqa",
        "dropout",
        "grad",
    ]

    def cell(v):
        if isinstance(v, bool):
            return "[green]yes[/]" if v else "[red]no[/]"
        return ", ".join(x.replace("float", "f").replace("bf", "bf") for x in v) if isinstance(v, list) else str(v)

    for c in [*caps, "dtypes"]:
        t.add_row(c.replace("_", " "), *(cell(r[c]) for r in rows))
    console.print(t)
    for r in rows:
        console.print(f"[bold]{r['name']}[/]: {r['summary']}", highlight=False)
