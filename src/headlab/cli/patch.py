"""``headlab patch``: activation patching of every head for one clean/corrupted prompt pair.

A row: the options, their checks (the degenerate pairs included, before the load) and the rendering are the
``patch`` instrument's (:mod:`headlab.interpret.instruments.patch`); the study runner checks, reads the four
texts, loads, runs the sweeps as units and writes.
"""

from __future__ import annotations

from headlab.cli.app import app
from headlab.cli.rows import row
from headlab.interpret.instruments.patch import METHODS  # noqa: F401  (its old home)
from headlab.interpret.instruments.patch import parse_positions as _positions  # noqa: F401  (its old name)

row(app, "patch", "patch")
row(app, "circuit", "circuit")  # edge patching's circuits: headlab.interpret.instruments.circuit
