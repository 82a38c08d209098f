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

console = Console()
err_console = Console(stderr=True)


def check_output_file(path: Path, option: str) -> Path:
    """Refuse, before any work, an output file that cannot be written: its folder must exist and
    take a file (tried for real: permissions, read-only mounts, /proc)."""
    path = Path(path).expanduser()
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"{option} {str(path)!r} is a folder; give a file name such as results.json")
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


def print_json(obj) -> None:
    """Machine-readable output: one JSON document on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


__all__ = ["app", "bench_app", "check_output_file", "console", "err_console", "human_bytes", "human_flops",
           "print_json"]
