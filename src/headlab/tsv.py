"""Labelled sentences from a TSV file: :func:`read_dataset`, the labelled reading of :func:`headlab.reading.read_tsv`.

The explain study, the SST-2 fine-tuning (:mod:`headlab.models.finetune`) and their commands read
GLUE-style files: a header row naming a text column ``sentence`` (or ``text``) and an integer
``label`` column, one example per line, tab-separated, no quoting. The file is read by
:mod:`headlab.reading` (the one input reader, so a missing, non-UTF-8 or malformed file gets the same line
everywhere); here the label column is required and a blank row is refused, naming its line, since a
training file with a hole in it is more likely cut than spaced.
"""

from __future__ import annotations

import os
from pathlib import Path

from headlab.errors import InputError
from headlab.reading import TEXT_COLUMNS, Row, read_tsv


def read_dataset(path: str | os.PathLike, limit: int | None = None, *, option: str = "dataset") -> list[Row]:
    """The rows of a TSV dataset; :class:`~headlab.errors.InputError` naming the file and line when it is malformed.

    ``option``: how messages name the file (``--dataset``; the default names it as a dataset)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"no dataset file {p}: give a TSV file with a header row (columns sentence, label)")
    return read_tsv(p, option, limit=limit, labelled=True, blank_rows=False)


__all__ = ["Row", "TEXT_COLUMNS", "read_dataset"]
