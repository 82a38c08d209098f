"""A result of any instrument: one envelope, one writer, one reader.

**The envelope.** Every result file headlab writes carries one header, under the key ``"headlab"``, beside
the result's own keys (which stay where readers of earlier files look for them)::

    {"headlab": {"kind": "patching", "version": "0.1.0", "model": "gpt2", "settings": {"method": "exact"}},
     "kind_of_result": "patching", "model": "gpt2", "effects": {...}, ...}

``kind`` names the instrument (what a reader dispatches on), ``version`` the headlab that wrote it,
``model`` the model's name and ``settings`` what the instrument was asked; everything beside the header is
the result's figures. The header sits under one key of its own because several results already use
``kind`` and ``settings`` for their own fields (an ablation's kind, an atlas's sizes). :class:`Result` reads
both this form and the files of earlier versions (``"kind_of_result"``, ``"kind": "headlab.probe"`` or no
header at all), and shows itself as a small table in a notebook (``_repr_html_``).

**The writer.** :func:`write_json` (and :func:`write_text` under it) writes a temporary file beside the
target and renames it over the target (``os.replace``), so a reader, or a run interrupted while writing,
never sees half a file. It writes standard JSON only (:func:`to_json_value`): NaN, inf and -inf become
``null`` with a note in the header's ``"notes"`` saying where; tensors, numpy arrays and numpy scalars become
lists and numbers; a path becomes its string; a set, or any other object JSON has no form for, is refused
(:class:`NotJSONError`, naming where it sits).

**The reader.** :func:`read_json` and :meth:`Result.load` check the header: a header without a kind is not a
headlab result, a file of another kind than the caller asks for (``kind=``) or of a newer headlab than this
one reads is refused (:class:`ResultFileError`), saying what was seen and what to do.

**The output check** (before any work: a file in the way, ``FILE/sub``, a read-only place, ``/proc``, a
folder with files in it unless ``--force``) is :mod:`headlab.outputs`'s.

    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> r = Result("patching", model="toy", settings={"method": "exact"}, figures={"clean": 1.5})
    >>> path = r.save(folder / "patching.json")
    >>> Result.load(path) == r
    True
    >>> Result.from_json({"kind_of_result": "pruning_curve", "model": "m", "values": [1]}).kind  # an earlier file
    'pruning_curve'
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path, PurePath

from headlab._version import __version__
from headlab.errors import ConfigError, HeadlabError, InputError
from headlab.outputs import Unwritable

HEADER = "headlab"  # the key the envelope's header sits under
# results whose files named their kind in a bare "kind" before the envelope (others use "kind" for their own
# fields, such as an ablation's kind, so only these are read as the result's kind)
EARLIER_KINDS = frozenset({"head_importance"})


def envelope(kind: str, figures: dict, *, model: str | None = None, settings: dict | None = None) -> dict:
    """``figures`` (a result's own JSON dict) with the envelope's header added: what every ``to_json`` returns.
    A dict that already carries a header is returned as it is.

    >>> d = envelope("rollout", {"n": 3}, model="m")
    >>> d["headlab"]["kind"], d["headlab"]["model"], d["n"]
    ('rollout', 'm', 3)
    """
    if isinstance(figures.get(HEADER), dict):
        return figures
    return Result(kind, model=model, settings=dict(settings or {}), figures=figures).to_json()


@dataclass
class Result:
    """Any instrument's result: its kind, the model, the settings it ran with and its figures (the payload)."""

    kind: str  # the instrument: "patching", "head_atlas", "probe", ...; what a reader dispatches on
    model: str | None = None  # the model's name (None: not a model's result, e.g. a benchmark)
    settings: dict = field(default_factory=dict)  # what the instrument was asked, enough to run it again
    figures: dict = field(default_factory=dict)  # the result's own keys, as its to_json has always written them
    version: str = __version__  # the headlab that computed it
    # what the writer noted (values JSON cannot hold, written as null), read back from the header's "notes"
    notes: list = field(default_factory=list, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind.strip():  # it names the result on disk and for readers
            raise ConfigError(f"a result's kind must be a non-empty string, got {self.kind!r}")

    def to_json(self) -> dict:
        head: dict = {"kind": self.kind, "version": self.version, "model": self.model, "settings": self.settings}
        if self.notes:
            head["notes"] = list(self.notes)
        return {HEADER: head, **{k: v for k, v in self.figures.items() if k != HEADER}}

    @classmethod
    def from_json(cls, data: dict) -> Result:
        """A result from its JSON dict: this envelope, or a file of an earlier version (no header)."""
        if not isinstance(data, dict):
            raise InputError(f"not a headlab result: a JSON {type(data).__name__}, not an object")
        head = data.get(HEADER)
        figures = {k: v for k, v in data.items() if k != HEADER}
        if isinstance(head, dict) and "kind" in head:
            notes = head.get("notes")
            return cls(
                head["kind"],
                model=head.get("model"),
                settings=dict(head.get("settings") or {}),
                figures=figures,
                version=head.get("version") or "unknown",
                notes=list(notes) if isinstance(notes, list) else [],
            )
        kind = data.get("kind_of_result")  # the earlier envelopes: "kind_of_result", "kind": "headlab.probe"
        own = data.get("kind")
        if kind is None and isinstance(own, str) and own.startswith("headlab."):
            kind = own.removeprefix("headlab.").replace(".", "_")  # "headlab.kv.gates": kv_gates
        elif kind is None and own in EARLIER_KINDS:
            kind = own
        model = data.get("model") if isinstance(data.get("model"), str) else None
        return cls(kind or "unknown", model=model, figures=figures, version="unknown")

    def save(self, path: str | os.PathLike, *, indent: int | None = 1) -> Path:
        """Write the result as JSON (atomically: :func:`write_json`)."""
        return write_json(path, self.to_json(), indent=indent)

    @classmethod
    def load(
        cls, path: str | os.PathLike, *, what: str = "a result file headlab wrote", kind: str | None = None
    ) -> Result:
        """A result file read back (:func:`read_json`: the header's kind and version checked; ``kind``, if
        given, is the kind the file must hold)."""
        return cls.from_json(read_json(path, what=what, kind=kind))

    def _repr_html_(self) -> str:
        """A small table: the header, then one row per setting and per figure (long values cut short)."""

        def cell(v) -> str:
            text = json.dumps(v, default=str)
            return html.escape(text if len(text) <= 80 else text[:77] + "...")

        rows = [("kind", self.kind), ("model", self.model or "-"), ("headlab", self.version)]
        rows += [(f"settings.{k}", cell(v)) for k, v in self.settings.items()]
        rows += [(k, cell(v)) for k, v in self.figures.items()]
        body = "".join(
            f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td><code>{v}</code></td></tr>" for k, v in rows
        )
        return f"<table>{body}</table>"


# ---- the writer -----------------------------------------------------------------------------------


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically: a temporary file beside it, then ``os.replace``."""
    path = Path(path).expanduser()
    if path.is_dir():  # os.replace would fail only after the temporary file is written
        raise InputError(f"{str(path)!r} is a folder; give a file name such as result.json")
    folder = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as e:  # /proc, FILE/sub, a missing or read-only folder: one line, not the system's traceback
        raise Unwritable(
            f"{str(path)!r} cannot be written: {e.strerror or e} in {str(folder)!r}; choose a writable place",
            reason=str(e.strerror or e),
        ) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class NotJSONError(HeadlabError, TypeError):
    """A value the result writer has no JSON form for (a set, an object of another kind); ``path`` says where it
    sits in the document (``"scores[3]"``, ``"headlab.settings.layers"``; ``""``: the document itself)."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


NOTES_KEY = "headlab_notes"  # where the writer's notes go in a JSON object without the envelope's header
NOTES_NAMED = 5  # up to this many values written as null are named one by one; more are counted per path


def to_json_value(obj, notes: list[str] | None = None):
    """``obj`` as the values standard JSON holds (dict, list, str, int, float, bool, None): what the writer
    writes. NaN, inf and -inf become ``None`` (JSON's ``null``), each one noted in ``notes`` (counted per path
    when there are more than :data:`NOTES_NAMED`); a tuple becomes a list; a torch tensor, a numpy array or a
    numpy scalar becomes its (nested) list or number; a path (``pathlib``) becomes its string. A set is refused
    (its order is not fixed: pass a sorted list), and so is any other object: :class:`NotJSONError`.

    >>> notes = []
    >>> to_json_value({"scores": [1.0, float("nan")], "pair": (1, 2)}, notes), notes
    ({'scores': [1.0, None], 'pair': [1, 2]}, ['scores[1] was NaN, written as null'])
    """
    found: list[tuple[str, str]] = []
    value = _plain(obj, "", found, set())
    if notes is not None:
        notes.extend(_notes(found))
    return value


def _plain(obj, path: str, found: list, inside: set):
    if obj is None or isinstance(obj, (bool, str, int)):  # str and int subclasses (str or int enums) as json does
        return obj
    if isinstance(obj, float):  # numpy's float64 too
        if math.isfinite(obj):
            return float(obj)
        found.append((path, "NaN" if math.isnan(obj) else "inf" if obj > 0 else "-inf"))
        return None
    if isinstance(obj, (dict, list, tuple)):
        if id(obj) in inside:
            raise NotJSONError(
                f"{path or 'the document'} holds itself, which JSON cannot write; save a copy without the loop",
                path=path,
            )
        inside.add(id(obj))
        try:
            if isinstance(obj, dict):
                return {
                    _key(k, path): _plain(v, f"{path}.{k}" if path else str(k), found, inside) for k, v in obj.items()
                }
            return [_plain(v, f"{path}[{i}]", found, inside) for i, v in enumerate(obj)]
        finally:
            inside.discard(id(obj))
    if isinstance(obj, (set, frozenset)):
        raise NotJSONError(
            f"{path or 'the document'} is a {type(obj).__name__} ({len(obj)} items), which JSON has "
            "no form for and whose order is not fixed; pass a sorted list (sorted(...)) instead",
            path=path,
        )
    if isinstance(obj, PurePath):
        return str(obj)
    torch = sys.modules.get("torch")  # a tensor can only exist where torch is imported: no import here
    if torch is not None and isinstance(obj, torch.Tensor):
        try:
            values = obj.detach().cpu().tolist()
        except (RuntimeError, NotImplementedError) as e:
            raise NotJSONError(
                f"{path or 'the document'} is a tensor whose values cannot be read ({e}); save a "
                "tensor with values (on any device)",
                path=path,
            ) from None
        return _plain(values, path, found, inside)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, (np.ndarray, np.generic)):
        return _plain(obj.tolist(), path, found, inside)  # a numpy scalar's tolist() is its Python number
    kind = type(obj)
    raise NotJSONError(
        f"{path or 'the document'} is a {kind.__module__}.{kind.__qualname__}, which JSON has no form "
        "for; convert it to a dict, list, str or number before saving",
        path=path,
    )


def _key(k, path: str):
    """A dict key as JSON takes it: a string, or a number, bool or None that json writes as a string."""
    if k is None or isinstance(k, (str, bool, int)):
        return k
    if isinstance(k, float):
        return float(k) if math.isfinite(k) else json.dumps(k)  # a NaN key is the string "NaN", as before
    np = sys.modules.get("numpy")
    if np is not None and isinstance(k, np.generic):
        return _key(k.item(), path)
    raise NotJSONError(
        f"{path or 'the document'} has a key {k!r} ({type(k).__name__}); JSON keys are strings, so "
        "use str keys (e.g. '0.1' for the head (0, 1))",
        path=path,
    )


def _notes(found: list[tuple[str, str]]) -> list[str]:
    """One note per value written as null, or (more than :data:`NOTES_NAMED`) one per path with the indices
    starred: ``scores[*]: 40 NaN, 2 inf, written as null``."""
    if len(found) <= NOTES_NAMED:
        return [f"{p or 'the document'} was {what}, written as null" for p, what in found]
    groups: dict[str, dict[str, int]] = {}
    for p, what in found:
        counts = groups.setdefault(re.sub(r"\[\d+\]", "[*]", p) or "the document", {})
        counts[what] = counts.get(what, 0) + 1
    return [
        f"{p}: {', '.join(f'{n} {what}' for what, n in counts.items())}, written as null"
        for p, counts in groups.items()
    ]


def dumps(obj, *, indent: int | None = 1, ensure_ascii: bool = True) -> str:
    """``obj`` as standard JSON text (:func:`to_json_value`; no bare NaN or Infinity). The notes of values
    written as null go into the envelope's header (``"headlab": {..., "notes": [...]}``), or beside the keys
    of an object without one (:data:`NOTES_KEY`); a list or a number has no place for them, so they are a
    ``RuntimeWarning``."""
    notes: list[str] = []
    value = to_json_value(obj, notes)
    if notes:
        value = _noted(value, notes)
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, allow_nan=False)


def _noted(doc, notes: list[str]):
    def merged(earlier) -> list:
        earlier = earlier if isinstance(earlier, list) else []
        return earlier + [n for n in notes if n not in earlier]

    if isinstance(doc, dict) and isinstance(doc.get(HEADER), dict):
        return {**doc, HEADER: {**doc[HEADER], "notes": merged(doc[HEADER].get("notes"))}}
    if isinstance(doc, dict):
        return {**doc, NOTES_KEY: merged(doc.get(NOTES_KEY))}
    warnings.warn(f"not finite, written as null: {'; '.join(notes)}", RuntimeWarning, stacklevel=4)
    return doc


def write_json(path: str | os.PathLike, obj, *, indent: int | None = 1, ensure_ascii: bool = True) -> Path:
    """Write ``obj`` as standard JSON (:func:`dumps`; one trailing newline) to ``path``, atomically; every result
    file goes through here."""
    return write_text(path, dumps(obj, indent=indent, ensure_ascii=ensure_ascii) + "\n")


# ---- the reader -----------------------------------------------------------------------------------


class ResultFileError(InputError):
    """A JSON file the result reader refuses: not a headlab result, a result of another kind than the caller
    asked for, or one written by a newer headlab than this one reads."""


def read_json(path: str | os.PathLike, *, what: str = "a JSON file", kind: str | None = None):
    """A JSON file's content, or one line saying why not (missing, a folder, not UTF-8, not JSON: the one
    reader's :func:`headlab.reading.read_json_file`); a result's header is checked (:func:`check_header`), and
    with ``kind`` the file must hold a result of that kind. Files of earlier versions (bare NaN included) read."""
    from headlab.reading import read_json_file

    data = read_json_file(path, what=what)
    check_header(data, kind=kind, source=repr(str(Path(path).expanduser())), what=what)
    return data


def check_header(
    data, *, kind: str | None = None, source: str = "the file", what: str = "a result file headlab wrote"
) -> str | None:
    """The kind of result ``data`` holds, once its header is checked: a header (``"headlab": {...}``) must name a
    kind and a version this headlab reads (:func:`reads_version`); with ``kind`` the result must be of that kind
    (a file of an earlier version without the header, by its earlier kind field). None: no header, no ``kind``
    asked (a JSON file of another sort, read as it is). Refusals are :class:`ResultFileError`."""
    head = data.get(HEADER) if isinstance(data, dict) else None
    if isinstance(head, dict):
        seen = head.get("kind")
        if not isinstance(seen, str) or not seen:
            raise ResultFileError(
                f"{source} is not a headlab result: its {HEADER!r} header has no kind (it has "
                f"{', '.join(map(repr, head)) or 'no keys'}); give {what}"
            )
        version = head.get("version")
        if version is not None and not isinstance(version, str):
            raise ResultFileError(
                f"{source} is not a headlab result: its header's version {version!r} is not a "
                f"version string; give {what}"
            )
        if version and not reads_version(version):
            raise ResultFileError(
                f"{source} was written by headlab {version}, newer than this headlab "
                f"({__version__}) reads; upgrade headlab (pip install -U headlab) to read it"
            )
    elif kind is None:
        return None
    elif not isinstance(data, dict):
        raise ResultFileError(
            f"{source} is not a headlab result: a JSON {type(data).__name__}, not an object; give {what}"
        )
    else:
        seen = Result.from_json(data).kind
        if seen == "unknown":
            raise ResultFileError(
                f"{source} is not a headlab result: it has no {HEADER!r} header (nor an earlier "
                f"file's kind); give {what}"
            )
    if kind is not None and seen != kind:
        raise ResultFileError(f"{source} holds a {seen!r} result, not {kind!r}; give {what}")
    return seen


def _release(version: str) -> tuple[int, ...] | None:
    m = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def reads_version(version: str) -> bool:
    """Whether this headlab reads files written by headlab ``version``: its own series and earlier ones (before
    1.0 a minor release may change the files, so 0.1 reads 0.1.x and earlier, not 0.2; from 1.0 the major
    release counts). A version that is no release number (``"unknown"``, an earlier file) is read."""
    theirs, ours = _release(version), _release(__version__)
    if theirs is None or ours is None:
        return True
    width = 2 if ours[0] == 0 else 1
    return (theirs + (0,) * width)[:width] <= (ours + (0,) * width)[:width]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def print_json(obj) -> None:
    """Machine-readable output (a command's ``--json``): one standard JSON document on stdout (:func:`dumps`)."""
    sys.stdout.write(dumps(obj, indent=2) + "\n")


__all__ = [
    "NotJSONError",
    "Result",
    "ResultFileError",
    "check_header",
    "dumps",
    "envelope",
    "print_json",
    "read_json",
    "reads_version",
    "to_json_value",
    "write_json",
    "write_text",
]
