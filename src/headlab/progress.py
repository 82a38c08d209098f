"""Progress of long work, on stderr: a rich bar on a terminal, plain lines everywhere else.

Rich draws nothing useful when stderr is not a terminal (a log file, CI, a notebook's captured
stream, ``2> run.log``): a bar redrawn in place becomes nothing or noise. :func:`progress` returns
rich's :class:`~rich.progress.Progress` on a terminal and :class:`PlainProgress` otherwise, which
prints a line at its first step, then at most one every ``every`` seconds or 10% of the work, and
one when it ends (a task that never steps, such as a command refused before its work, prints
nothing)::

    importance (task): 1/55 (2%) 0.3 s
    importance (task): 12/55 (22%) 10.1 s
    importance (task): 55/55 (100%) 41.3 s, done

Both take the same calls (``add_task``, ``update``, ``advance``, used as a context manager), so a
loop is written once. ``HEADLAB_PROGRESS=plain`` or ``=rich`` forces one of them.

    >>> import io
    >>> buf = io.StringIO()
    >>> with PlainProgress(stream=buf, every=0) as bar:
    ...     t = bar.add_task("sentences", total=4)
    ...     bar.advance(t, 2)
    ...     bar.update(t, completed=4)
    >>> print(buf.getvalue().replace("0.0 s", "T"), end="")
    sentences: 2/4 (50%) T
    sentences: 4/4 (100%) T, done
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field


def plain_wanted(stream=None) -> bool:
    """Whether progress should be plain lines: ``HEADLAB_PROGRESS`` says so, or the stream is not a terminal."""
    mode = os.environ.get("HEADLAB_PROGRESS", "").strip().lower()
    if mode in ("plain", "rich"):
        return mode == "plain"
    stream = sys.stderr if stream is None else stream
    return not (hasattr(stream, "isatty") and stream.isatty())


def progress(*columns, transient: bool = False, console=None, description: str = "{task.description}"):
    """A progress display for long work on stderr: rich on a terminal, :class:`PlainProgress` elsewhere.

    ``columns``: rich columns for the terminal (default: description, bar, done/total, elapsed)."""
    if plain_wanted():
        return PlainProgress()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = columns or (TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=console or Console(stderr=True), transient=transient)


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    last_line: float = field(default_factory=time.perf_counter)
    last_share: float = 0.0
    finished: bool = False
    shown: bool = False  # a line was printed


class PlainProgress:
    """rich.progress.Progress's calls, written as plain lines (see the module docstring)."""

    def __init__(self, stream=None, every: float = 10.0) -> None:
        self.stream = stream
        self.every = every
        self.tasks: dict[int, _Task] = {}

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc) -> bool:
        for t in self.tasks.values():
            if t.shown and not t.finished and exc[0] is None:
                self._line(t, end=True)
        return False

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **_) -> int:
        tid = len(self.tasks)
        self.tasks[tid] = _Task(description, total, float(completed))  # its first line comes with its first step
        return tid

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(self, task_id: int, *, completed: float | None = None, total: float | None = None,
               advance: float | None = None, description: str | None = None, **_) -> None:
        t = self.tasks[task_id]
        renamed = description is not None and description != t.description
        if description is not None:
            t.description = description
        if total is not None:
            t.total = total
        if completed is not None:
            t.completed = float(completed)
        if advance:
            t.completed += advance
        now = time.perf_counter()
        share = t.completed / t.total if t.total else 0.0
        first = not t.shown and t.completed > 0
        if t.total and t.completed >= t.total and not t.finished:
            self._line(t, end=True)
        elif first or renamed or now - t.last_line >= self.every or share - t.last_share >= 0.1:
            self._line(t)  # a new step's name, or enough time or work since the last line

    def _count(self, t: _Task) -> str:
        done = f"{t.completed:g}"
        return f"{done}/{t.total:g}" if t.total else done

    def _line(self, t: _Task, end: bool = False) -> None:
        now = time.perf_counter()
        share = f" ({100 * t.completed / t.total:.0f}%)" if t.total else ""
        self._write(f"{t.description}: {self._count(t)}{share} {now - t.started:.1f} s" + (", done" if end else ""))
        t.last_line, t.last_share, t.shown = now, (t.completed / t.total if t.total else 0.0), True
        t.finished = t.finished or end

    def _write(self, line: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        print(line, file=stream, flush=True)


__all__ = ["PlainProgress", "plain_wanted", "progress"]


def progress_bar(enabled: bool):
    """:func:`progress` when ``enabled``, else a stand-in that takes the same calls and shows nothing
    (for library functions with a ``progress=False`` argument)."""
    return progress() if enabled else _Silent()


class _Silent:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, *a, **k):
        return 0

    def advance(self, *a, **k):
        pass

    def update(self, *a, **k):
        pass
