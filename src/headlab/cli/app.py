"""The Typer application and what every command shares: consoles, units, the error rule.

Every instrument is a command of :data:`app` through the command table (:mod:`headlab.cli.table`: read from
the instrument registry, imported when it runs); the plain commands (``memory``, ``backends``, ``models``,
``demo``, ``bench``, ``train-classifier``) live one module each in this package and register on :data:`app`
(``headlab.cli.main`` imports them; they import the library inside the command, so ``headlab --help`` imports
neither torch nor transformers). Commands parse, call the library, render: no arithmetic here.
"""

from __future__ import annotations

from pathlib import Path

import typer

import headlab.checks as checks
from headlab.cli.table import CommandGroup
from headlab.cli.terminal import INTERRUPTED_EXIT, console, err_console, invoked
from headlab.outputs import check_output_dir, check_output_file
from headlab.reading import read_file, read_text
from headlab.results import print_json
from headlab.units import human_bytes, human_flops

app = typer.Typer(
    cls=CommandGroup,  # the instruments' rows come from the registry (headlab.cli.table)
    name="headlab",
    help="Multi-head attention: the mechanism, its cost, efficient variants, and what each head does.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks: time and memory of attention backends.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


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
    if value is not None:
        checks.at_least(option, value, low, what=what)


def __getattr__(name: str):
    """Names the commands used to import from here, loaded on first use (they import torch or transformers)."""
    if name == "peek_max_positions":  # sizes checked before the load
        from headlab.models.peek import peek_max_positions

        return peek_max_positions
    if name == "heads_text":  # the KV heads' summary line
        from headlab.decode.instrument import kv_heads_text

        return kv_heads_text
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "INTERRUPTED_EXIT",
    "app",
    "bench_app",
    "check_at_least",
    "check_output_dir",
    "check_output_file",
    "check_text",
    "console",
    "err_console",
    "human_bytes",
    "human_flops",
    "invoked",
    "print_json",
    "read_text_file",
]
