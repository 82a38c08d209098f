"""``headlab heads importance|ablate|prune``: which heads matter, and removing the ones that do not.

The group's commands are instruments (``command = "heads importance"`` ...: :mod:`headlab.interpret.instruments.heads`
and :mod:`headlab.interpret.instruments.prune`), found by the command table (:mod:`headlab.cli.table`).
"""

from __future__ import annotations

import typer

from headlab.cli.app import app
from headlab.cli.table import group

heads_app = typer.Typer(
    cls=group("heads"),
    help="Which heads matter: importance, ablation verdicts, physical pruning.",
    no_args_is_help=True,
)
app.add_typer(heads_app, name="heads")
