"""A result of any instrument: one envelope, one writer, one check of where it goes.

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
never sees half a file.

**The output check.** :func:`check_output_file` and :func:`check_output_dir` refuse, before any work, a
path that cannot take the results (a file in the way, ``FILE/sub``, a read-only place, ``/proc``, a folder
with files in it unless ``--force``), in the option's own name. The CLI and the library's jobs both call them.

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
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from headlab._version import __version__
from headlab.errors import InputError

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

    def to_json(self) -> dict:
        head = {"kind": self.kind, "version": self.version, "model": self.model, "settings": self.settings}
        return {HEADER: head, **{k: v for k, v in self.figures.items() if k != HEADER}}

    @classmethod
    def from_json(cls, data: dict) -> Result:
        """A result from its JSON dict: this envelope, or a file of an earlier version (no header)."""
        if not isinstance(data, dict):
            raise InputError(f"not a headlab result: a JSON {type(data).__name__}, not an object")
        head = data.get(HEADER)
        figures = {k: v for k, v in data.items() if k != HEADER}
        if isinstance(head, dict) and "kind" in head:
            return cls(head["kind"], model=head.get("model"), settings=dict(head.get("settings") or {}),
                       figures=figures, version=head.get("version") or "unknown")
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
    def load(cls, path: str | os.PathLike, *, what: str = "a result file headlab wrote") -> Result:
        return cls.from_json(read_json(path, what=what))

    def _repr_html_(self) -> str:
        """A small table: the header, then one row per setting and per figure (long values cut short)."""
        def cell(v) -> str:
            text = json.dumps(v, default=str)
            return html.escape(text if len(text) <= 80 else text[:77] + "...")

        rows = [("kind", self.kind), ("model", self.model or "-"), ("headlab", self.version)]
        rows += [(f"settings.{k}", cell(v)) for k, v in self.settings.items()]
        rows += [(k, cell(v)) for k, v in self.figures.items()]
        body = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td><code>{v}</code></td></tr>"
                       for k, v in rows)
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
        raise Unwritable(f"{str(path)!r} cannot be written: {e.strerror or e} in {str(folder)!r}; choose a "
                         "writable place", reason=str(e.strerror or e)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | os.PathLike, obj, *, indent: int | None = 1, ensure_ascii: bool = True) -> Path:
    """Write ``obj`` as JSON (one trailing newline) to ``path``, atomically; every result file goes through here."""
    return write_text(path, json.dumps(obj, indent=indent, ensure_ascii=ensure_ascii, default=str) + "\n")


def read_json(path: str | os.PathLike, *, what: str = "a JSON file") -> dict:
    """A JSON file's content, or one line saying why not (missing, a folder, not UTF-8, not JSON): the one
    reader's :func:`headlab.reading.read_json_file`."""
    from headlab.reading import read_json_file

    return read_json_file(path, what=what)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---- where results go -----------------------------------------------------------------------------


def _writable(folder: Path, option: str, path: Path) -> None:
    """Try a file in ``folder`` for real (permissions, read-only mounts, /proc): :class:`Unwritable` if it fails."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise Unwritable(f"{option} {str(path)!r} cannot be written: {e.strerror or e} in {str(folder)!r}; choose "
                         "a writable place (nothing has been computed yet)", reason=str(e.strerror or e)) from None


class Unwritable(InputError):
    """An output place where no file can be made; ``reason`` is the system's word for it ("Permission denied")."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _existing_ancestor(path: Path) -> Path:
    """The nearest part of ``path`` (itself or a parent) that exists."""
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(".")


def check_output_file(path: str | os.PathLike, option: str, *, force: bool = False) -> Path:
    """Refuse, before any work, an output file that cannot be written: its folder must exist and
    take a file (tried for real: permissions, read-only mounts, /proc); an existing file is kept
    unless ``force`` (CLI: ``--force``). Folders: :func:`check_output_dir`."""
    path = Path(path).expanduser()
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"{option} {str(path)!r} is a folder; give a file name such as results.json")
    if path.exists() and not force:
        raise InputError(f"{option} {str(path)!r} exists; choose another name, or pass --force to replace it "
                         "(nothing has been computed yet)")
    if parent.exists() and not parent.is_dir():
        raise InputError(f"{option} {str(path)!r}: {str(parent)!r} is a file, not a folder; give a path in a folder "
                         "(nothing has been computed yet)")
    if not parent.is_dir():
        raise InputError(f"{option} {str(path)!r}: the folder {str(parent)!r} does not exist; create it first "
                         "(nothing has been computed yet)")
    _writable(parent, option, path)
    if path.exists() and not os.access(path, os.W_OK):
        raise Unwritable(f"{option} {str(path)!r} cannot be written: Permission denied "
                         "(nothing has been computed yet)", reason="Permission denied")
    return path


def check_output_dir(path: str | os.PathLike, option: str, *, force: bool = False,
                     allow_existing: bool = False) -> Path:
    """Refuse, before any work, an output folder that cannot take files: a file in its place or above
    it (``FILE/sub``: :class:`Unwritable`), a place where nothing can be written (permissions, read-only
    mounts, /proc: :class:`Unwritable`), or a folder that already holds files (unless ``force``, or
    ``allow_existing`` for commands that add their files beside others). Nothing is created: the folder
    is made when the results are written."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise InputError(f"{option} {str(path)!r} is a file; give a folder (it is created if missing)")
    if path.is_dir():
        if not (force or allow_existing) and any(path.iterdir()):
            raise InputError(f"{option} {str(path)!r} exists and is not empty; choose another folder, or pass "
                             "--force to write into it (nothing has been computed yet)")
        _writable(path, option, path)
        return path
    base = _existing_ancestor(path)
    if not base.is_dir():
        raise Unwritable(f"{option} {str(path)!r}: {str(base)!r} is a file, so no folder can be made under it; "
                         "give a folder path (nothing has been computed yet)", reason="Not a directory")
    _writable(base, option, path)
    return path



def print_json(obj) -> None:
    """Machine-readable output (a command's ``--json``): one JSON document on stdout."""
    import sys

    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")

__all__ = ["print_json", "Result", "Unwritable", "check_output_dir", "check_output_file", "envelope", "read_json", "write_json",
           "write_text"]
