"""Per-head notes for ``headlab analyze``: each head's Kendall tau with integrated gradients on this text.

For a classifier (or decoder) explanation that has both ``attention`` (with every layer's rows)
and ``integrated_gradients``, head (l, h)'s row from the classification position is ranked against
|IG| over the non-special tokens: ``"tau with IG +0.42 (p 0.03)"``. The coordinator wires this into
the report's per-head table (``head_annotations``, the convention every room follows).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from headlab.errors import InputError
from headlab.interpret.saliency.agreement import rank_agreement


def head_taus(ex, reference: str = "integrated_gradients") -> dict[tuple[int, int], tuple[float, float]]:
    """``{(layer, head): (kendall_tau, p)}`` of each head's classification row with ``|reference|``."""
    data = ex.to_json(heads=True) if hasattr(ex, "to_json") else ex
    rows = data.get("attention_layers")
    if rows is None or reference not in data.get("scores", {}):
        raise InputError(f"per-head agreement needs an explanation with 'attention' (every layer) and {reference!r}")
    keep = [i for i, s in enumerate(data["special"]) if not s]
    ref = np.abs(np.asarray(data["scores"][reference], dtype=float))[keep]
    out = {}
    for layer, heads in enumerate(rows):
        for head, row in enumerate(heads):
            tau, p, _, _ = rank_agreement(np.asarray(row, dtype=float)[keep], ref)
            out[(layer, head)] = (tau, p)
    return out


def head_annotations(result_or_path, reference: str = "integrated_gradients") -> dict[tuple[int, int], str]:
    """``{(layer, head): "tau with IG +0.42 (p 0.03)"}`` from an Explanation or an ``explanation.json`` path."""
    if isinstance(result_or_path, (str, os.PathLike)):
        p = Path(result_or_path)
        if p.is_dir():
            p = p / "explanation.json"
        if not p.is_file():
            raise InputError(f"no explanation file {p}: write one with `headlab explain TEXT --model M --out DIR`")
        from headlab.reading import read_json_file

        result_or_path = read_json_file(p, what="the explanation.json headlab explain wrote")
    short = {"integrated_gradients": "IG", "leave_one_out": "LOO"}.get(reference, reference)
    return {
        k: ("tau with " + short + " n/a" if tau != tau else f"tau with {short} {tau:+.2f} (p {p:.2g})")
        for k, (tau, p) in head_taus(result_or_path, reference).items()
    }
