"""Findings of other studies about each head, shown by the ``analyze`` report: :func:`study_annotations`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from headlab.errors import InputError


def study_annotations(
    *, probe: str | os.PathLike | None = None, heads: str | os.PathLike | None = None
) -> dict[tuple[int, int], list[str]]:
    """Per-head findings of other studies, for :func:`analyze` (``annotations=``):

    - ``probe``: a result of ``headlab probe`` (``relations.json`` or its ``--json`` output): the heads
      that best track a dependency relation ("det head: 78% vs offset baseline 41%");
    - ``heads``: a result of ``headlab heads importance|ablate`` (``importance.json``, ``ablation.json``):
      importance ranks, single-ablation effects and verdicts.

    Files are read here, before any model work, so a bad path fails at once.
    """
    out: dict[tuple[int, int], list[str]] = {}
    sources: list[tuple[str, str | os.PathLike, Callable]] = []
    if probe is not None:
        from headlab.interpret.probing import head_annotations as probe_notes

        sources.append(("probe", probe, probe_notes))
    if heads is not None:
        from headlab.interpret.heads.page import head_annotations as heads_notes

        sources.append(("heads", heads, heads_notes))
    for what, path, fn in sources:
        if not Path(path).is_file():
            raise InputError(f"--{what} {path}: no such file (give the JSON a `headlab {what}` run wrote)")
        _check_kind(what, path)
        try:
            found = fn(path)
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"--{what} {path} is not a headlab {what} result: {e}") from None
        for key, text in found.items():
            out.setdefault((int(key[0]), int(key[1])), []).append(text)
    return out


KINDS = {"probe": ("probe",), "heads": ("head_importance", "head_ablation")}  # the result kinds each option reads


def _check_kind(what: str, path) -> None:
    """The file is a JSON object, and when it carries a headlab envelope, one of the kinds ``--what`` reads (a
    rollout given to --heads-result was accepted and showed nothing)."""
    from headlab.reading import read_json_file

    flag = "--heads-result" if what == "heads" else f"--{what}"
    try:
        data = read_json_file(path, what=f"the JSON a `headlab {what}` run wrote")
    except InputError as e:
        raise InputError(f"{flag} {path} is not a headlab {what} result: {e}") from None
    if not isinstance(data, dict):
        raise InputError(f"{flag} {path} is not a headlab {what} result: a JSON {type(data).__name__}, not an object")
    kind = data.get("headlab", {}).get("kind") if isinstance(data.get("headlab"), dict) else None
    if kind is not None and kind not in KINDS[what]:
        raise InputError(
            f"{flag} {path} holds a {kind} result; give the {' or '.join(KINDS[what])} result a "
            f"`headlab {what}` run wrote"
        )
