"""``headlab probe --treebank FILE.conllu``: which heads track which dependency relations (Clark et al. 2019).

A row: the options, their checks and the rendering are the ``probe`` instrument's
(:mod:`headlab.interpret.instruments.probe`); the study runner checks, reads, loads, runs and writes.
"""

from __future__ import annotations

from headlab.cli.app import app
from headlab.cli.rows import row

row(app, "probe", "probe")
