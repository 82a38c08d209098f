"""Input files and texts, read in one place: :func:`read` and one function per kind.

Every instrument names the inputs it reads by kind, and the study runner reads them here, before any model
loads, so that every command says the same thing about the same bad file, in one line that names the option,
what was seen and what to do:

- ``"text"``: a text given on the command line (empty, or bytes that are not UTF-8, are refused);
- ``"texts"``: a plain-text file, one text per non-blank line;
- ``"tsv"``: a tab-separated file whose header names a text column ``sentence`` (or ``text``) and, optionally,
  an integer ``label`` column (GLUE style, no quoting);
- ``"conllu"``: a CoNLL-U treebank, checked line by line (ten tab-separated columns, a word index in the first);
  the sentences come back as blocks of lines, and the probing room builds its trees from the same file;
- ``"json"``: a JSON document (a result headlab wrote, an atlas, a configuration).

A file that is missing, a folder, a device, not UTF-8 or not the format is an
:class:`~headlab.errors.InputError` (a :class:`~headlab.errors.TreebankError` for CoNLL-U)::

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "d.tsv"
    >>> _ = p.write_text("sentence\\tlabel\\na fine film\\t1\\n")
    >>> [(r.line, r.text, r.label) for r in read("tsv", p, "--data")]
    [(2, 'a fine film', 1)]
    >>> _ = p.write_bytes(b"caf\\xe9\\n")
    >>> read("texts", p, "--texts")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    headlab.errors.InputError: --texts '...d.tsv' is not UTF-8 text: byte 0xe9 at byte 3 of 5; convert it first, ...
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from headlab.errors import InputError, TreebankError

KINDS = ("text", "texts", "tsv", "conllu", "json")
# how each kind is described in a message: what to give, the noun of a missing file, the format's name
WHAT = {
    "text": "a text",
    "texts": "a plain-text file (UTF-8), one text per line",
    "tsv": "a TSV file whose header names a sentence (or text) column and an optional integer label",
    "conllu": "a CoNLL-U file (.conllu)",
    "json": "a JSON file",
}
_NOUN = {"texts": "text", "tsv": "dataset", "conllu": "treebank", "json": "JSON"}
_FORMAT = {"tsv": None, "texts": None, "conllu": "CoNLL-U", "json": "JSON"}
_ERROR = {"conllu": TreebankError}
_ICONV = "convert it first, e.g. iconv -f latin1 -t utf-8"
TEXT_COLUMNS = ("sentence", "text")
_CONLLU_ID = re.compile(r"^(\d+)(?:-(\d+)|\.(\d+))?$")


@dataclass(frozen=True)
class Row:
    """One example of a TSV file."""

    line: int  # 1-based line in the file (the header is line 1)
    text: str
    label: int | None  # None when the file has no label column

    @property
    def key(self) -> str:
        """``"line:sha1"``: names the example in a study's records (a resumed study skips the ones it has)."""
        return f"{self.line}:{hashlib.sha1(self.text.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class Conllu:
    """A CoNLL-U file whose lines were checked: its path and its sentences as blocks of ``(line number, line)``."""

    path: Path
    sentences: list[list[tuple[int, str]]]

    def texts(self) -> list[str]:
        """Each sentence's ``# text = ...`` comment (sentences without one are left out)."""
        return [
            line.split("=", 1)[1].strip()
            for block in self.sentences
            for _, line in block
            if line.startswith("# text =")
        ]


def check_utf8(text: str) -> str:
    """Refuse a text that arrived as bytes that are not UTF-8 (Python hands them over as surrogate escapes),
    saying which byte and where; the text itself otherwise.

    >>> check_utf8("caf\\udce9")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    headlab.errors.InputError: the text is not valid UTF-8: byte 0xe9 at byte 3 of 4; convert it first, ...
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text.encode("utf-8", "surrogateescape")
        bad = text[e.start : e.end].encode("utf-8", "surrogateescape")
        pos = len(text[: e.start].encode("utf-8", "surrogateescape"))
        raise InputError(
            f"the text is not valid UTF-8: byte 0x{bad[0]:02x} at byte {pos} of {len(raw)}; {_ICONV}"
        ) from None
    return text


def read_text(text: str, option: str) -> str:
    """A text given on the command line: refused when empty or not UTF-8 (the byte and where), naming the option.

    >>> read_text("the cat", "TEXT")
    'the cat'
    """
    if not text.strip():
        raise InputError(f"{option} is empty; give a text")
    try:
        return check_utf8(text)
    except InputError as e:
        raise InputError(f"{option}: {e}") from None


def _name(option: str, path) -> str:
    """How a message names a file: ``--data '/x/d.tsv'``, or the path alone when no option reads it."""
    return f"{option} {str(path)!r}" if option else repr(str(path))


def read_file(path: str | os.PathLike, option: str, kind: str = "texts", *, what: str | None = None) -> str:
    """A file's text, or one line saying why not: missing, a folder, not a regular file, unreadable, not UTF-8
    (the byte and how to convert), or empty (a treebank says "holds no sentence")."""
    what = what or WHAT[kind]
    error = _ERROR.get(kind, InputError)
    path = Path(path).expanduser()
    name = _name(option, path)
    if path.is_dir():
        raise error(f"{name} is a folder; give {what}")
    if not path.is_file():
        if path.exists():
            raise error(f"{name} is not a regular file (a device or a pipe); give {what}")
        raise error(f"{name} does not exist (no such {_NOUN.get(kind, 'input')} file); give {what}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise error(f"{name} cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        fmt = f"not {_FORMAT[kind]}: " if _FORMAT.get(kind) else ""
        raise error(
            f"{name} is {fmt}not UTF-8 text: byte 0x{raw[e.start]:02x} at byte {e.start} of {len(raw)}; {_ICONV}"
        ) from None
    if not text.strip():
        if kind == "conllu":
            raise error(f"{name} holds no sentence (the file is empty or has only comments); give {what}")
        raise error(f"{name} is empty; give {what}")
    return text


def read_texts(path: str | os.PathLike, option: str, *, limit: int | None = None) -> list[str]:
    """The non-blank lines of a plain-text file, stripped (at most ``limit`` of them)."""
    texts = [ln.strip() for ln in read_file(path, option, "texts").splitlines() if ln.strip()]
    return texts[:limit] if limit else texts


def read_tsv(
    path: str | os.PathLike, option: str, *, limit: int | None = None, labelled: bool = False, blank_rows: bool = True
) -> list[Row]:
    """The rows of a TSV dataset (see the module docstring); one line naming the file's line when malformed.

    ``labelled``: the ``label`` column is required (a classifier's training and study files);
    ``blank_rows``: a blank line between examples is skipped (False: it is refused, naming its line)."""
    name = _name(option, Path(path).expanduser())
    text = read_file(path, option, "tsv")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)
    header = [h.strip() for h in next(reader)]
    lower = [h.lower() for h in header]
    text_col = next((c for c in TEXT_COLUMNS if c in lower), None)
    if labelled and (text_col is None or "label" not in lower):
        missing = [n for n, ok in (("sentence (or text)", text_col), ("label", "label" in lower)) if not ok]
        raise InputError(
            f"{name}: no column {' and '.join(missing)}; the header has {header}. The dataset needs a "
            "text column named sentence or text and an integer label column"
        )
    if text_col is None:
        raise InputError(
            f"{name}: no 'sentence' or 'text' column; the header has {header}. Give a TSV whose "
            "header names the text column sentence (or text), with an optional integer label"
        )
    ti, li = lower.index(text_col), (lower.index("label") if "label" in lower else None)
    rows: list[Row] = []
    for n, rec in enumerate(reader, start=2):
        if not rec or not any(c.strip() for c in rec):
            if blank_rows:
                continue  # a blank line between examples
            raise InputError(
                f"{name} line {n}: empty row; remove it (every row needs a {text_col}"
                f"{' and a label' if li is not None else ''})"
            )
        if len(rec) <= max(ti, li or 0):
            raise InputError(f"{name} line {n}: {len(rec)} field(s) for a header of {len(header)}; is a tab missing?")
        value = rec[ti].strip()
        if not value:
            raise InputError(f"{name} line {n}: the {text_col} is empty; give every row a text")
        label = None
        if li is not None:
            try:
                label = int(rec[li].strip())
            except ValueError:
                raise InputError(f"{name} line {n}: label {rec[li].strip()!r} is not an integer class") from None
        rows.append(Row(n, value, label))
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise InputError(f"{name} has a header but no rows (an empty dataset); give at least one example")
    return rows


def read_conllu(path: str | os.PathLike, option: str = "", *, limit: int | None = None) -> Conllu:
    """A CoNLL-U file checked line by line: every word line has ten tab-separated columns and a word index
    (``3``, a range ``3-4`` or an empty node ``8.1``) first, and a HEAD that is an index or ``_``. A bad
    line is named ``FILE:LINE`` (``--treebank t.conllu:7: not CoNLL-U: ...``), as compilers name theirs, so
    an editor jumps to it. ``limit``: at most this many sentences (blocks), from the top."""
    p = Path(path).expanduser()
    text = read_file(p, option, "conllu")
    blocks: list[list[tuple[int, str]]] = []
    block: list[tuple[int, str]] = []
    for n, raw in enumerate(text.split("\n"), 1):
        line = raw.rstrip("\r")
        if not line.strip():
            if block:
                blocks.append(block)
            block = []
            if limit and len(blocks) >= limit:
                break
            continue
        if not line.startswith("#"):
            _check_conllu_line(str(p), option, n, line)
        block.append((n, line))
    if block and not (limit and len(blocks) >= limit):
        blocks.append(block)
    if not any(not line.startswith("#") for b in blocks for _, line in b):
        raise TreebankError(
            f"{_name(option, p)} holds no sentence (the file is empty or has only comments); give {WHAT['conllu']}"
        )
    return Conllu(p, blocks)


def _check_conllu_line(path: str, option: str, n: int, line: str) -> None:
    cols = line.split("\t")
    where = f"{option + ' ' if option else ''}{path}:{n}: not CoNLL-U"
    if len(cols) != 10:
        hint = " (columns must be separated by tabs, not spaces)" if len(cols) == 1 and " " in line else ""
        raise TreebankError(
            f"{where}: expected 10 tab-separated columns (ID FORM LEMMA UPOS XPOS FEATS HEAD DEPREL "
            f"DEPS MISC), got {len(cols)}{hint}: {line[:60]!r}"
        )
    m = _CONLLU_ID.match(cols[0])
    if m is None:
        raise TreebankError(
            f"{where}: ID {cols[0]!r} is not a word index (1, 2, ...), a multi-word range (3-4) or an empty node (8.1)"
        )
    if m.group(2) is None and m.group(3) is None and cols[6] != "_" and not cols[6].isdigit():
        raise TreebankError(f"{where}: HEAD {cols[6]!r} of word {cols[0]} is not a word index (0 for the root)")


def read_json_file(path: str | os.PathLike, option: str = "", *, what: str | None = None):
    """A JSON document, or one line naming the option, the line and column where it stops being JSON."""
    if not isinstance(path, str | os.PathLike):  # Path(None) is a TypeError from pathlib
        raise InputError(
            f"{option or 'the path'} must be a file path (a str or a pathlib.Path), got "
            f"{type(path).__name__}; give {what or WHAT['json']}"
        )
    p = Path(path).expanduser()
    text = read_file(path, option, "json", what=what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(
            f"{_name(option, p)} is not JSON: {e.msg} at line {e.lineno} column {e.colno}; give {what or WHAT['json']}"
        ) from None


def read(kind: str, value, option: str, *, limit: int | None = None):
    """Read ``value`` (a text, or a file's path) as ``kind`` (one of :data:`KINDS`), in ``option``'s name."""
    if kind == "text":
        return read_text(str(value), option)
    if kind == "texts":
        return read_texts(value, option, limit=limit)
    if kind == "tsv":
        return read_tsv(value, option, limit=limit)
    if kind == "conllu":
        return read_conllu(value, option, limit=limit)
    if kind == "json":
        return read_json_file(value, option)
    raise InputError(f"no reader for inputs of kind {kind!r}; use one of {', '.join(KINDS)}")


__all__ = [
    "Conllu",
    "KINDS",
    "Row",
    "TEXT_COLUMNS",
    "WHAT",
    "check_utf8",
    "read",
    "read_conllu",
    "read_file",
    "read_json_file",
    "read_text",
    "read_texts",
    "read_tsv",
]
