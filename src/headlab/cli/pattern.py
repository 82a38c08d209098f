"""``headlab pattern NAME``: draw a sparse attention pattern and its density.

A row: the options, their checks and the rendering are the ``pattern`` instrument's
(:mod:`headlab.interpret.instruments.pattern`); the study runner checks (``--png`` too), runs and writes.
"""

from __future__ import annotations

from headlab.cli.app import app
from headlab.cli.rows import row
from headlab.interpret.instruments.pattern import MAX_DENSE, build, spec  # noqa: F401  (registers; their old home)

row(app, "pattern", "pattern")
