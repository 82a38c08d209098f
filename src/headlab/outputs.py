"""Where results go: the one check of an output path, made before any work.

:func:`check_output_file` and :func:`check_output_dir` refuse, before any work, a path that cannot take the
results (a file in the way, ``FILE/sub``, a read-only place, ``/proc``, a folder with files in it unless
``--force``), in the option's own name. The CLI and the library's jobs both call them. A place where no file
can be made is :class:`Unwritable` (the result writer, :func:`headlab.results.write_text`, says so too).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from headlab.errors import InputError


def _writable(folder: Path, option: str, path: Path) -> None:
    """Try a file in ``folder`` for real (permissions, read-only mounts, /proc): :class:`Unwritable` if it fails."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise Unwritable(
            f"{option} {str(path)!r} cannot be written: {e.strerror or e} in {str(folder)!r}; choose "
            "a writable place (nothing has been computed yet)",
            reason=str(e.strerror or e),
        ) from None


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
        raise InputError(
            f"{option} {str(path)!r} exists; choose another name, or pass --force to replace it "
            "(nothing has been computed yet)"
        )
    if parent.exists() and not parent.is_dir():
        raise InputError(
            f"{option} {str(path)!r}: {str(parent)!r} is a file, not a folder; give a path in a folder "
            "(nothing has been computed yet)"
        )
    if not parent.is_dir():
        raise InputError(
            f"{option} {str(path)!r}: the folder {str(parent)!r} does not exist; create it first "
            "(nothing has been computed yet)"
        )
    _writable(parent, option, path)
    if path.exists() and not os.access(path, os.W_OK):
        raise Unwritable(
            f"{option} {str(path)!r} cannot be written: Permission denied (nothing has been computed yet)",
            reason="Permission denied",
        )
    return path


def check_output_dir(
    path: str | os.PathLike, option: str, *, force: bool = False, allow_existing: bool = False
) -> Path:
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
            raise InputError(
                f"{option} {str(path)!r} exists and is not empty; choose another folder, or pass "
                "--force to write into it (nothing has been computed yet)"
            )
        _writable(path, option, path)
        return path
    base = _existing_ancestor(path)
    if not base.is_dir():
        raise Unwritable(
            f"{option} {str(path)!r}: {str(base)!r} is a file, so no folder can be made under it; "
            "give a folder path (nothing has been computed yet)",
            reason="Not a directory",
        )
    _writable(base, option, path)
    return path


__all__ = ["Unwritable", "check_output_dir", "check_output_file"]
