"""The Typer application and what every command shares: consoles, units, the error rule.

Commands live one module each in this package and register on :data:`app` (or a sub-app);
``headlab.cli.main`` imports them. Commands parse, call the library, render: no arithmetic here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.console import Console

from headlab.errors import ConfigError
from headlab.models.peek import peek_max_positions  # noqa: F401  (sizes checked before the load, here for the commands)
from headlab.reading import check_utf8, read_file, read_text  # noqa: F401  (the one reader, for the commands)
from headlab.decode.instrument import kv_heads_text as heads_text  # noqa: F401  (the KV heads' summary line)
from headlab.results import check_output_dir, check_output_file, print_json  # noqa: F401  (the one output check, here for the commands)
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


def read_text_file(path: Path, option: str, *, what: str = "a plain-text file (UTF-8)", kind: str = "texts") -> str:
    """The text of an input file, or one line saying why not: missing, a folder, unreadable, not UTF-8
    (with the byte and how to convert), or empty; :func:`headlab.reading.read_file` (the one reader)."""
    return read_file(path, option, kind, what=what)


def check_text(text: str, option: str) -> str:
    """A text given on the command line: refused when empty or not UTF-8 (the bytes and where), naming the
    option; :func:`headlab.reading.read_text` (the one reader)."""
    return read_text(text, option)


def check_at_least(option: str, value, low, *, what: str = "") -> None:
    """``value >= low`` (and finite), or a ConfigError in the option's name."""
    if value is None:
        return
    if value != value or value in (float("inf"), float("-inf")) or value < low:
        raise ConfigError(f"{option} must be at least {low}{what}, got {value}")


__all__ = ["app", "bench_app", "check_at_least", "check_output_dir", "check_output_file", "check_text", "console",
           "err_console", "human_bytes", "human_flops", "peek_max_positions", "print_json", "read_text_file"]
