"""The Typer application and what every command shares: consoles, units, the error rule.

Commands live one module each in this package and register on :data:`app` (or a sub-app);
``headlab.cli.main`` imports them. Commands parse, call the library, render: no arithmetic here.
"""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console

from headlab.attention.guard import human_bytes

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


def human_flops(n: float) -> str:
    """``8.8e12 -> '8.80 TFLOP'``."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def print_json(obj) -> None:
    """Machine-readable output: one JSON document on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


__all__ = ["app", "bench_app", "console", "err_console", "human_bytes", "human_flops", "print_json"]
