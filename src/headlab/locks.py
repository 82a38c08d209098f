"""One writer per output: a lock file beside an output path while a run writes it.

Two runs given the same ``--out`` at once would both finish and the later would silently replace the earlier; the
runner holds :func:`output_lock` on its output from the checks to the last file written, and a second run is
refused before it reads or loads anything. The lock is a file ``.<name>.lock`` beside the output holding the
writer's process id; a lock left by a process that no longer runs (killed with SIGKILL, a machine restarted) is
taken over, not obeyed.

    >>> import tempfile, pathlib
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "r.json"
    >>> with output_lock(out, "--out"):
    ...     with output_lock(out, "--out"):
    ...         pass
    Traceback (most recent call last):
    ...
    headlab.errors.InputError: --out '...r.json' is being written by another headlab run (process ...); wait for it to finish, or choose another path
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from headlab.errors import InputError

__all__ = ["lock_path", "output_lock"]


def lock_path(path: Path) -> Path:
    """The lock file of ``path``: ``.<name>.lock`` beside it (outside a folder output, so it is not one of its files)."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


@contextlib.contextmanager
def output_lock(path: Path, option: str = "--out") -> Iterator[Path]:
    """Hold ``path`` for this process until the block ends; refuse (InputError) when another live run holds it.

    Nothing is locked when the folder the lock would go in does not exist yet (nothing is made before the run has
    work to write; two runs racing to create a new folder are told apart by the output check of the second)."""
    lock = lock_path(path)
    if not lock.parent.is_dir():
        yield lock
        return
    for _ in range(2):  # a stale lock is removed once, then taken
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _alive(pid):
                raise InputError(
                    f"{option} {str(path)!r} is being written by another headlab run (process {pid}); "
                    "wait for it to finish, or choose another path"
                ) from None
            with contextlib.suppress(OSError):
                lock.unlink()
            continue
        except OSError:  # a read-only place: the output check decides; nothing to lock here
            yield lock
            return
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        try:
            yield lock
        finally:
            with contextlib.suppress(OSError):
                lock.unlink()
        return
    yield lock
