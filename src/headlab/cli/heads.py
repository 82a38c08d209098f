"""``headlab heads importance|ablate|prune``: which heads matter, and removing the ones that do not."""

from __future__ import annotations

import typer

from headlab.cli.app import app
from headlab.cli.rows import row

heads_app = typer.Typer(help="Which heads matter: importance, ablation verdicts, physical pruning.",
                        no_args_is_help=True)
app.add_typer(heads_app, name="heads")

# importance and ablate are rows: their options, checks and rendering are instruments
# (headlab.interpret.instruments.heads), run by the study runner
row(heads_app, "importance", "heads-importance")
row(heads_app, "ablate", "heads-ablate")


# prune is a row too (headlab.interpret.instruments.prune)
row(heads_app, "prune", "heads-prune")
