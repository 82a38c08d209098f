"""``headlab generate "PROMPT"`` and ``headlab train-gates``: decode with a KV cache shaped per head, and train the
gates that choose which heads keep it whole.

Rows: the options (``--policy`` also answers to ``--kv-policy``), their checks, the work and the rendering are the
``generate`` and ``train-gates`` instruments' (:mod:`headlab.decode.instrument`); the study runner checks, reads,
loads, runs and writes.
"""

from __future__ import annotations

from headlab.cli.app import app
from headlab.cli.rows import row
from headlab.decode.instrument import build_policy, read_policy_file  # noqa: F401  (their old home)

row(app, "generate", "generate")
row(app, "train-gates", "train-gates")
