"""The Typer application and what every command shares: consoles, units, the error rule.

Commands live one module each in this package and register on :data:`app` (or a sub-app);
``headlab.cli.main`` imports them. Commands parse, call the library, render: no arithmetic here.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import typer
from rich.console import Console

from headlab.errors import InputError
from headlab.units import human_bytes, human_flops

app = typer.Typer(
    name="headlab",
    help="Multi-head attention: the mechanism, its cost, efficient variants, and what each head does.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks: time and memory of attention backends.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

def _piped_width(stream) -> int | None:
    """Rich draws 80 columns when output is not a terminal, cutting table cells; piped output (a log,
    a file, ``| less``) gets a wide page instead, unless ``COLUMNS`` says otherwise."""
    return None if os.environ.get("COLUMNS") or stream.isatty() else 200


console = Console(width=_piped_width(sys.stdout))
err_console = Console(stderr=True, width=_piped_width(sys.stderr))


def check_heads_before_loading(model: str, heads: str | None, option: str = "--heads") -> None:
    """``--heads LAYER.HEAD,...`` checked against the model's config files (no weights read), so a
    head the model lacks stops the command before the load and the work."""
    if heads is None:
        return
    from headlab.interpret.report.analyze_job import parse_heads
    from headlab.models.loader import peek_layer_heads

    counts = peek_layer_heads(model)
    if counts is not None:
        try:
            parse_heads(heads, len(counts), counts)
        except InputError as e:
            raise InputError(f"{option} {heads} is out of range: {e}") from None


def check_output_file(path: Path, option: str, *, force: bool = False) -> Path:
    """Refuse, before any work, an output file that cannot be written: its folder must exist and
    take a file (tried for real: permissions, read-only mounts, /proc); an existing file is kept
    unless ``force`` (CLI: ``--force``)."""
    path = Path(path).expanduser()
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"{option} {str(path)!r} is a folder; give a file name such as results.json")
    if path.exists() and not force:
        raise InputError(f"{option} {str(path)!r} exists; choose another name, or pass --force to replace it "
                         "(nothing has been computed yet)")
    if not parent.is_dir():
        raise InputError(f"{option} {str(path)!r}: the folder {str(parent)!r} does not exist; create it first "
                         "(nothing has been computed yet)")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise InputError(f"{option} {str(path)!r} cannot be written: {e.strerror or e} "
                         "(nothing has been computed yet)") from None
    return path


def stage_bar():
    """``(display, say)``: a progress display on stderr and ``say(stage, done, total)``, which gives each
    stage (a phase of a long command) its own bar, what the library's ``progress=`` callbacks call."""
    from headlab.progress import progress

    display = progress(console=err_console, transient=True)
    tasks: dict[str, int] = {}

    def say(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = display.add_task(stage, total=total)
        display.update(tasks[stage], completed=done, total=total)

    return display, say


def print_json(obj) -> None:
    """Machine-readable output: one JSON document on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


__all__ = ["app", "bench_app", "check_output_file", "console", "err_console", "human_bytes", "human_flops",
           "print_json", "stage_bar"]
