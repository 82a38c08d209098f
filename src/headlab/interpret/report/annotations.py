"""Findings of other studies about each head, shown by the ``analyze`` report: :func:`study_annotations`."""

from __future__ import annotations

import os
from pathlib import Path

from headlab.errors import InputError


def study_annotations(*, probe: str | os.PathLike | None = None,
                      heads: str | os.PathLike | None = None) -> dict[tuple[int, int], list[str]]:
    """Per-head findings of other studies, for :func:`analyze` (``annotations=``):

    - ``probe``: a result of ``headlab probe`` (``relations.json`` or its ``--json`` output): the heads
      that best track a dependency relation ("det head: 78% vs offset baseline 41%");
    - ``heads``: a result of ``headlab heads importance|ablate`` (``importance.json``, ``ablation.json``):
      importance ranks, single-ablation effects and verdicts.

    Files are read here, before any model work, so a bad path fails at once.
    """
    out: dict[tuple[int, int], list[str]] = {}
    sources = []
    if probe is not None:
        from headlab.interpret.probing import head_annotations as probe_notes

        sources.append(("probe", probe, probe_notes))
    if heads is not None:
        from headlab.interpret.heads.page import head_annotations as heads_notes

        sources.append(("heads", heads, heads_notes))
    for what, path, fn in sources:
        if not Path(path).is_file():
            raise InputError(f"--{what} {path}: no such file (give the JSON a `headlab {what}` run wrote)")
        try:
            found = fn(path)
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"--{what} {path} is not a headlab {what} result: {e}") from None
        for key, text in found.items():
            out.setdefault(tuple(key), []).append(text)
    return out
