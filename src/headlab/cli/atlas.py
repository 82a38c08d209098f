"""``headlab atlas``: every head's roles, checked causally.

A row: the options, their checks and the rendering are the ``atlas`` instrument's
(:mod:`headlab.interpret.instruments.atlas`); the study runner checks, loads, runs and writes.
"""

from __future__ import annotations

from headlab.cli.app import app
from headlab.cli.rows import row
from headlab.interpret.instruments.atlas import PARTIAL  # noqa: F401  (its old home)

row(app, "atlas", "atlas")
