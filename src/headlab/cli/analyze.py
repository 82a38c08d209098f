"""``headlab analyze "TEXT"``: every attention head of a model on a text, as a report folder.

A row: the options, their checks and the rendering are the ``analyze`` instrument's
(:mod:`headlab.interpret.report.instrument`); the study runner checks, loads, records once, runs and writes.
"""

from __future__ import annotations

from headlab.cli.app import app, console
from headlab.cli.rows import row
from headlab.interpret.report import instrument as _instrument  # registers the instrument
from headlab.interpret.report.analyze_job import ReportResult


def render_summary(r: ReportResult) -> None:
    """Where the files are, the mode, and the clearest head of each pattern (``headlab demo`` shows it too)."""
    _instrument.render_summary(r, console)


row(app, "analyze", "analyze")
