"""Labelled sentences from a TSV file: :func:`read_dataset`, the one reader of ``sentence``/``label`` files.

The explain study, the SST-2 fine-tuning (:mod:`headlab.models.finetune`) and their commands read
GLUE-style files: a header row naming a text column ``sentence`` (or ``text``) and an integer
``label`` column, one example per line, tab-separated, no quoting. A malformed file is an
:class:`~headlab.errors.InputError` naming the file and the line.
"""

from __future__ import annotations

import csv
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from headlab.errors import InputError

TEXT_COLUMNS = ("sentence", "text")


@dataclass
class Row:
    line: int  # 1-based line in the file (the header is line 1)
    text: str
    label: int | None

    @property
    def key(self) -> str:
        return f"{self.line}:{hashlib.sha1(self.text.encode()).hexdigest()[:12]}"


def read_dataset(path: str | os.PathLike, limit: int | None = None) -> list[Row]:
    """The rows of a TSV dataset; :class:`~headlab.errors.InputError` naming the file and line when it is malformed."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputError(f"no dataset file {p}: give a TSV file with a header row (columns sentence, label)")
    rows: list[Row] = []
    with open(p, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if not header:
            raise InputError(f"{p} is empty: it needs a header row with columns sentence (or text) and label")
        header = [h.strip() for h in header]
        text_col = next((c for c in TEXT_COLUMNS if c in header), None)
        if text_col is None or "label" not in header:
            missing = [n for n, ok in (("sentence (or text)", text_col), ("label", "label" in header)) if not ok]
            raise InputError(f"{p}: no column {' and '.join(missing)}; the header has {header}. "
                             "The dataset needs a text column named sentence or text and an integer label column")
        ti, li = header.index(text_col), header.index("label")
        for n, rec in enumerate(reader, start=2):
            if not rec or not any(c.strip() for c in rec):
                raise InputError(f"{p} line {n}: empty row; remove it (every row needs a {text_col} and a label)")
            if len(rec) <= max(ti, li):
                raise InputError(f"{p} line {n}: {len(rec)} field(s) for a header of {len(header)}; "
                                 "is a tab missing?")
            text, label = rec[ti].strip(), rec[li].strip()
            if not text:
                raise InputError(f"{p} line {n}: the {text_col} is empty")
            try:
                lab = int(label)
            except ValueError:
                raise InputError(f"{p} line {n}: label {label!r} is not an integer class") from None
            rows.append(Row(n, text, lab))
            if limit and len(rows) >= limit:
                break
    if not rows:
        raise InputError(f"{p} has a header but no rows")
    return rows


__all__ = ["Row", "TEXT_COLUMNS", "read_dataset"]
