"""``headlab flow TEXT``: attention rollout, attention flow and value-aware norms of one text.

A row: the options, their checks and the rendering are the ``flow`` instrument's
(:mod:`headlab.interpret.instruments.flow`); the study runner checks, loads, runs and writes.
"""

from __future__ import annotations

from headlab.cli.app import app
from headlab.cli.rows import row
from headlab.interpret.instruments.flow import METHODS, MODES, SOLVERS, parse_rows  # noqa: F401  (their old home)

row(app, "flow", "flow")
