"""The runner's one checkpoint: the units a result file keeps, so an interrupted run goes on with ``--resume``.

A run interrupted by Ctrl-C writes its finished units' values under ``"units"`` (with ``"interrupted": {"kept": k,
"of": n}``) in its result file when that is JSON, else in a ``.partial.json`` beside it; a finished resumable
result keeps them too (and the run's settings beside them when the result's own differ). :func:`earlier_units`
reads them back for ``--resume``, after checking the file's kind and the run's settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from headlab.errors import InputError
from headlab.interpret.study.base import Context
from headlab.results import Result, to_json_value

UNITS_KEY = "units"  # where a file keeps its units' values (interrupted files, and finished resumable ones)
UNITS_SETTINGS_KEY = "units_settings"  # the run's settings beside them, when the result's own are other
INTERRUPTED_KEY = "interrupted"


def earlier_units(ctx: Context, keys: Sequence[str]) -> dict:
    """The units' values a resumed run keeps from the output file (none when there is no file yet)."""
    if ctx.path is None:
        return {}
    partial = partial_path(ctx)  # an interrupted run of a result that is not JSON kept its units beside it
    source = partial if partial.is_file() else ctx.path
    if not source.is_file() or source.suffix.lower() != ".json":  # a finished page keeps no units: all run again
        return {}
    assert ctx.instrument.output is not None  # a path comes from the instrument's output
    flag = ctx.instrument.option(ctx.instrument.output.option).label
    # in the words the run was started with: a library call's arguments, or the command's flags
    resume, drop = ("resume=True", "pass resume=False") if ctx.python else ("--resume", "drop --resume")
    earlier = Result.load(source, what=f"a {ctx.instrument.result_kind} result to resume")
    if earlier.kind != ctx.instrument.result_kind:
        raise InputError(
            f"{flag} {str(source)!r} holds a {earlier.kind} result, not {ctx.instrument.result_kind}; "
            f"{drop} or choose another path"
        )
    units = earlier.figures.get(UNITS_KEY)
    if not isinstance(units, dict):
        raise InputError(f"{resume}: {str(ctx.path)!r} keeps no units to resume from; {drop} to start again")
    now = to_json_value(ctx.settings)  # as the file holds them (NaN as null, paths as strings)
    saved = earlier.figures.get(UNITS_SETTINGS_KEY, earlier.settings)
    if saved != now:
        diff = sorted(k for k in set(now) | set(saved) if now.get(k) != saved.get(k))
        raise InputError(
            f"{resume}: {str(ctx.path)!r} was computed with other settings ({', '.join(diff)}); run "
            f"with the same options, or {drop} to start again"
        )
    return {k: ctx.instrument.unit_from_json(units[k]) for k in keys if k in units}


def partial_result(ctx: Context, values: dict, total: int) -> Result:
    inst = ctx.instrument
    return Result(
        inst.result_kind,
        model=getattr(ctx.loaded, "name", None),
        settings=ctx.settings,
        figures={
            INTERRUPTED_KEY: {"kept": len(values), "of": total},
            UNITS_KEY: {k: inst.unit_to_json(v) for k, v in values.items()},
        },
    )


def partial_path(ctx: Context) -> Path:
    """Where an interrupted run's units go: the result file when it is JSON (a resumed run reads it back), else a
    ``.partial.json`` beside it (``--out report.html`` keeps its units as JSON, not in the page's name); for an
    instrument whose output is a folder of its own files, ``NAME.partial.json`` in that folder."""
    path = ctx.path
    assert path is not None  # called for a run that writes
    if writes_folder(ctx):
        return path / f"{ctx.instrument.name}.partial.json"
    return path if path.suffix.lower() == ".json" else path.with_name(path.stem + ".partial.json")


def writes_folder(ctx: Context) -> bool:
    """The run's output is a folder of the instrument's own files (``output.file`` None), not one result file."""
    spec = ctx.instrument.output
    return spec is not None and spec.folder and spec.file is None


def resume_line(command: str) -> str:
    """The command line that resumes ``command``: itself with ``--resume`` (once)."""
    return command if " --resume" in f" {command} " else f"{command} --resume"


__all__ = [
    "INTERRUPTED_KEY",
    "UNITS_KEY",
    "UNITS_SETTINGS_KEY",
    "earlier_units",
    "partial_path",
    "partial_result",
    "resume_line",
    "writes_folder",
]
