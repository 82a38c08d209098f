"""``headlab explain``: attention against saliency for one prediction, or the study over a dataset.

A row: the options, their checks and the rendering are the ``explain`` instrument's
(:mod:`headlab.interpret.instruments.explain`); the study runner checks, reads, loads, runs and writes (the
corpus study keeps its own resumable file, progress and torchrun split, as the instrument says).
"""

from __future__ import annotations

from headlab.cli.app import app, console
from headlab.cli.rows import row
from headlab.interpret.instruments import explain as _instrument
from headlab.interpret.instruments.explain import SHORT  # noqa: F401  (its old home)


def render_explanation(ex) -> None:
    """One explanation on stdout (the instrument's rendering, kept here under its old name)."""
    _instrument.render_explanation(ex, console)


def render_study(r) -> None:
    """The corpus study's tables on stdout (the instrument's rendering, kept here under its old name)."""
    _instrument.render_study(r, console)


row(app, "explain", "explain")
