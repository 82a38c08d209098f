"""Progress of long work, on stderr: the one place headlab builds a progress display.

**The protocol.** Long work reports ``progress(stage, done, total)``: ``done`` of ``total`` units of
``stage`` (a phase: "sentences", "patching", "needle decoding") are finished; ``total=0`` is a step whose
length is not known ("loading model minilm"). Every library function with a ``progress=`` argument takes
one family of values: ``False``/``None`` (nothing), ``True`` (a display on stderr) or such a callable;
:func:`reporter` turns any of them into the callable, for as long as the work runs::

    def work(items, *, progress=False):
        with reporter(progress) as say:
            for i, item in enumerate(items):
                ...
                say("items", i + 1, len(items))

**The display.** :class:`Stages` is that callable on stderr: a rich bar per stage on a terminal
(description, bar, done/total, elapsed, time left), and :class:`PlainProgress` lines everywhere else (a
log file, CI, a notebook's captured stream, ``2> run.log``), where a bar redrawn in place becomes nothing
or noise. A plain stage prints a line when it starts, then one at most every ``every`` seconds or 10% of
the work, one at least every ``every`` seconds while it runs (a heartbeat, so a phase that takes minutes
between steps still says it is alive), and one when it ends, with an estimate of the time left::

    sentences: 1/55 (2%) 0.3 s, about 16 s left
    sentences: 12/55 (22%) 10.1 s, about 36 s left
    sentences: 55/55 (100%) 41.3 s, done

``HEADLAB_PROGRESS=plain`` or ``=rich`` forces one of them.

    >>> import io, re
    >>> buf = io.StringIO()
    >>> with Stages(PlainProgress(stream=buf, every=0)) as say:
    ...     say("sentences", 0, 4)
    ...     say("sentences", 2, 4)
    ...     say("sentences", 4, 4)
    >>> print(re.sub(r"\\d+\\.\\d s|\\d+ s", "T", buf.getvalue()), end="")
    sentences: 0/4 (0%) T
    sentences: 2/4 (50%) T, about T left
    sentences: 4/4 (100%) T, done

:func:`progress` (rich's :class:`~rich.progress.Progress` or :class:`PlainProgress`, with ``add_task`` /
``update`` / ``advance``) and :func:`progress_bar` are the lower level the display is built on, for the
few loops that drive a bar themselves.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from headlab.errors import ConfigError

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: ``done`` of ``total`` units of ``stage`` finished (``total`` 0: not known)."""


def plain_wanted(stream=None) -> bool:
    """Whether progress should be plain lines: ``HEADLAB_PROGRESS`` says so, or the stream is not a terminal."""
    mode = os.environ.get("HEADLAB_PROGRESS", "").strip().lower()
    if mode in ("plain", "rich"):
        return mode == "plain"
    stream = sys.stderr if stream is None else stream
    return not (hasattr(stream, "isatty") and stream.isatty())


def progress(*columns, transient: bool = False, console=None, description: str = "{task.description}"):
    """A progress display for long work on stderr: rich on a terminal, :class:`PlainProgress` elsewhere.

    ``columns``: rich columns for the terminal (default: description, bar, done/total, elapsed, time left)."""
    if plain_wanted():
        return PlainProgress()
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = columns or (
        TextColumn(description),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=console or Console(stderr=True), transient=transient)


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min"


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float = 0.0
    started: float = field(default_factory=lambda: time.perf_counter())
    last_line: float = field(default_factory=lambda: time.perf_counter())
    last_share: float = 0.0
    finished: bool = False
    shown: bool = False  # a line was printed
    first: float = 0.0  # the count at the start, so a resumed task's estimate counts only this run's rate

    def left(self, now: float) -> float | None:
        """Seconds left at this run's rate, or None when no rate is known yet."""
        rate = (self.completed - self.first) / max(now - self.started, 1e-9)
        if not self.total or self.completed <= self.first or rate <= 0:
            return None
        return max(self.total - self.completed, 0) / rate


class PlainProgress:
    """rich.progress.Progress's calls, written as plain lines (see the module docstring).

    A task prints its first line with its first step (or at once, ``add_task(..., announce=True)``); used
    as a context manager with ``every > 0``, a heartbeat prints a line for every running task that has
    been silent for ``every`` seconds."""

    def __init__(self, stream=None, every: float = 10.0) -> None:
        self.stream = stream
        self.every = every
        self.tasks: dict[int, _Task] = {}
        self._lock = threading.RLock()
        self._stop: threading.Event | None = None

    def __enter__(self) -> PlainProgress:
        if self.every > 0 and self._stop is None:
            self._stop = threading.Event()
            threading.Thread(target=self._heartbeat, args=(self._stop,), daemon=True, name="headlab-progress").start()
        return self

    def __exit__(self, *exc) -> Literal[False]:
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        with self._lock:
            for t in self.tasks.values():
                if t.shown and not t.finished and exc[0] is None:
                    self._line(t, end=True)
        return False

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(min(1.0, self.every)):
            with self._lock:
                now = time.perf_counter()
                for t in list(self.tasks.values()):
                    if not t.finished and now - t.last_line >= self.every:
                        self._line(t)

    def add_task(
        self, description: str, total: float | None = None, completed: float = 0, *, announce: bool = False, **_
    ) -> int:
        with self._lock:
            tid = len(self.tasks)
            self.tasks[tid] = t = _Task(description, total, float(completed), first=float(completed))
            if announce:
                self._line(t)
            return tid  # otherwise its first line comes with its first step

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(
        self,
        task_id: int,
        *,
        completed: float | None = None,
        total: float | None = None,
        advance: float | None = None,
        description: str | None = None,
        **_,
    ) -> None:
        with self._lock:
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
            elif not t.finished and (
                first or renamed or now - t.last_line >= self.every or share - t.last_share >= 0.1
            ):
                self._line(t)  # a new step's name, or enough time or work since the last line

    def finish(self, task_id: int) -> None:
        """End a task whose length was not known (no line: its last one said what it was)."""
        with self._lock:
            self.tasks[task_id].finished = True

    def _line(self, t: _Task, end: bool = False) -> None:
        now = time.perf_counter()
        if t.total:
            count = f" {t.completed:g}/{t.total:g} ({100 * t.completed / t.total:.0f}%)"
        else:
            count = f" {t.completed:g}" if t.completed else ""
        left = None if end else t.left(now)
        tail = ", done" if end else (f", about {_seconds(left)} left" if left is not None else "")
        self._write(f"{t.description}:{count} {now - t.started:.1f} s{tail}")
        t.last_line, t.last_share, t.shown = now, (t.completed / t.total if t.total else 0.0), True
        t.finished = t.finished or end

    def _write(self, line: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        print(line, file=stream, flush=True)


class Stages:
    """The display of the protocol: called as ``progress(stage, done, total)``, one bar (or plain lines) per
    stage. A stage of unknown length (``total`` 0) is a step: it ends when the next stage starts.

    ``display``: a :func:`progress` display to draw on (default: a new one, ``transient`` as given)."""

    def __init__(self, display=None, *, transient: bool = False, console=None) -> None:
        self.display = display if display is not None else progress(transient=transient, console=console)
        self.tasks: dict[str, int] = {}
        self._step: int | None = None  # the running step of unknown length

    def __enter__(self) -> Stages:
        self.display.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._end_step(said=exc[0] is None)
        return self.display.__exit__(*exc)

    def quiet_step(self, stage: str) -> None:
        """A step of unknown length whose plain line waits for its end ("loading model minilm: 2.3 s", when the
        next stage starts or the display closes) or for the heartbeat, if it runs long: a refusal raised inside
        it (a load refused, a check on the loaded model) stays the one line on stderr. On a terminal it is a
        step as any other (the display is redrawn in place)."""
        if not isinstance(self.display, PlainProgress):
            self(stage, 0, 0)
            return
        self._end_step()
        self.tasks[stage] = self._step = self.display.add_task(stage, total=None, announce=False)

    def __call__(self, stage: str, done: int, total: int) -> None:
        known = total if total and total > 0 else None
        if stage not in self.tasks:
            self._end_step()
            self.tasks[stage] = self.display.add_task(stage, total=known, completed=done, announce=True)
            if known is None:
                self._step = self.tasks[stage]
        else:
            self.display.update(self.tasks[stage], completed=done, total=known)

    def _end_step(self, said: bool = True) -> None:
        if self._step is None:
            return
        if isinstance(self.display, PlainProgress):
            if said and not self.display.tasks[self._step].shown:  # a quiet step that ended well: its line now
                with self.display._lock:
                    self.display._line(self.display.tasks[self._step])
            self.display.finish(self._step)
        else:  # rich: a full bar instead of a pulsing one
            self.display.update(self._step, total=1, completed=1)
        self._step = None


def _nothing(stage: str, done: int, total: int) -> None:
    """The progress of work that shows none."""


def _one_argument(fn) -> bool:
    """Whether ``fn`` takes exactly one positional argument (an older progress form), not three."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 1 or (len(positional) > 1 and all(p.default is not p.empty for p in positional[1:]))


def messages(fn: Callable[[str], None]) -> Progress:
    """The protocol for an older ``progress(message)`` callback: called with a stage's name when it starts."""
    started: set[str] = set()

    def say(stage: str, done: int, total: int) -> None:
        if stage not in started:
            started.add(stage)
            fn(stage)

    return say


def increments(fn: Callable[[int], None]) -> Progress:
    """The protocol for an older ``progress(k)`` callback: called with the units finished since the last call."""
    last: dict[str, int] = {}

    def say(stage: str, done: int, total: int) -> None:
        k = done - last.get(stage, 0)
        last[stage] = done
        if k:
            fn(k)

    return say


@contextlib.contextmanager
def reporter(
    progress: bool | Progress | None, *, legacy: Callable[[Callable], Progress] | None = None, transient: bool = False
) -> Iterator[Progress]:
    """The callable behind a library function's ``progress=`` argument, for as long as the work runs.

    ``True``: a :class:`Stages` display on stderr (closed when the work ends or is interrupted);
    ``False``/``None``: nothing; a callable ``progress(stage, done, total)``: itself. ``legacy`` adapts a
    one-argument callable of an older form (:func:`messages`, :func:`increments`), so old calls keep working.

    >>> seen = []
    >>> with reporter(lambda stage, done, total: seen.append((stage, done, total))) as say:
    ...     say("rows", 1, 2)
    >>> seen
    [('rows', 1, 2)]
    >>> with reporter(False) as say:
    ...     say("rows", 1, 2)  # nothing
    """
    if progress is None or isinstance(progress, bool | int):  # True, False, None (and 0 / 1)
        if progress:
            with Stages(transient=transient) as say:
                yield say
        else:
            yield _nothing
    elif callable(progress):
        yield legacy(progress) if legacy is not None and _one_argument(progress) else progress
    else:
        raise ConfigError(
            f"progress must be True, False or a callable progress(stage, done, total), "
            f"got {type(progress).__name__} {progress!r}"
        )


def progress_bar(enabled: bool):
    """:func:`progress` when ``enabled``, else a stand-in that takes the same calls and shows nothing
    (for loops that drive a bar themselves; a ``progress=`` argument goes through :func:`reporter`)."""
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


__all__ = [
    "PlainProgress",
    "Progress",
    "Stages",
    "increments",
    "messages",
    "plain_wanted",
    "progress",
    "progress_bar",
    "reporter",
]
