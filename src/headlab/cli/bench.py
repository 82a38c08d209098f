"""``headlab bench attention``: time and peak memory of attention backends, with the ratio to SDPA."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import typer
from rich.table import Table

from headlab.cli.app import bench_app, check_output_file, console, human_bytes
from headlab.errors import ConfigError
from headlab.progress import reporter
from headlab.results import write_json


def _measuring(say):
    """bench_attention's ``progress(text)`` ("sdpa @ 512: time 2/4") as the protocol: a stage per backend and
    length, counting its measurements."""
    counts: dict[str, int] = {}

    def measuring(text: str) -> None:
        stage = text.split(":")[0]
        counts[stage] = counts.get(stage, -1) + 1
        say(stage, counts[stage], 0)

    return measuring


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers like 1024,2048, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise ConfigError(f"{what} must be positive integers like 1024,2048, got {text!r}")
    return vals


def _gist(reason: str) -> str:
    """A few words before a reason printed under the table (the table cell holds only its number)."""
    if "needs about" in reason:
        return "skipped, does not fit in memory"
    if "memory not measured" in reason:
        return "memory not measured"
    return "skipped, not supported"


def _check_inputs_fit(n: int, *, batch: int, heads: int, head_dim: int, dtype: str, backward: bool) -> None:
    """The query, key, value and output tensors of the longest row must fit in this machine's memory, or one
    line before the run. (What fits the memory budget, ``HEADLAB_MEMORY_LIMIT`` included, the guard judges
    per row and lists as skipped; inputs past the whole machine would fail the allocation itself.)"""
    import os

    from headlab.costs import AttentionShape, parse_dtype
    from headlab.errors import MemoryBudgetError
    from headlab.units import human_bytes

    item = parse_dtype(AttentionShape(heads=1, q_len=1, dtype=dtype).dtype).itemsize  # an unknown dtype: refused here
    tensors = 4 * (2 if backward else 1)
    need = tensors * batch * heads * n * head_dim * item
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return
    if need > total:
        raise MemoryBudgetError(
            f"--seq-lens {n}: the inputs of one row ({tensors} tensors of {batch}x{heads}x{n}x"
            f"{head_dim}) need about {human_bytes(need)}, more than this machine's "
            f"{human_bytes(total)} of memory; give shorter --seq-lens",
            estimate_bytes=need,
            available_bytes=total,
            alternative=None,
        )


@bench_app.command("attention")
def attention_cmd(
    seq_lens: str = typer.Option("1024,2048,4096,8192", "--seq-lens", help="comma-separated sequence lengths"),
    backends: str = typer.Option("sdpa,tiled,reference", "--backends", help="comma-separated backend names"),
    causal: bool = typer.Option(False, "--causal", help="causal attention (torch's is_causal)"),
    backward: bool = typer.Option(False, "--backward", help="time forward + backward"),
    json_file: Path = typer.Option(None, "--json", help="also write the rows to this JSON file"),
    force: bool = typer.Option(False, "--force", help="replace the --json file if it exists"),
    pattern: str = typer.Option(None, "--pattern", help="a mask pattern, e.g. sliding_window:256"),
    feature_map: str = typer.Option(None, "--feature-map", help="linear attention feature map, e.g. favor:256"),
    heads: int = typer.Option(8, "--heads"),
    head_dim: int = typer.Option(64, "--head-dim"),
    batch: int = typer.Option(1, "--batch"),
    dtype: str = typer.Option("float32", "--dtype"),
    repeats: int = typer.Option(3, "--repeats", help="timed rounds (backends interleaved), after one warm-up"),
    memory: bool = typer.Option(True, "--memory/--no-memory", help="measure peak memory in a fresh process per row"),
) -> None:
    """Median time, peak extra memory and time / sdpa (torch SDPA timed in the same run) for each
    backend and sequence length. Calls the memory guard refuses are listed as skipped before anything runs.

    Example: headlab bench attention --seq-lens 1024,2048,4096 --backends sdpa,tiled,reference --causal
    """
    lens = _ints(seq_lens, "--seq-lens")
    names = [b.strip() for b in backends.split(",") if b.strip()]
    if not names:
        raise ConfigError("--backends is empty; give names like sdpa,tiled")
    from headlab.attention.measure import bench_attention, check_counts  # here: `headlab --help` imports no torch
    from headlab.spec.masks import from_string

    check_counts(repeats=repeats, batch=batch, heads=heads, head_dim=head_dim)
    if pattern is not None:
        from_string(pattern)  # a bad spec fails here, before any timing
    if json_file is not None:
        check_output_file(json_file, "--json", force=force)  # before the run, so no result is lost
    _check_inputs_fit(max(lens), batch=batch, heads=heads, head_dim=head_dim, dtype=dtype, backward=backward)
    with reporter(True, transient=True) as say:
        rows = bench_attention(
            lens,
            names,
            causal=causal,
            backward=backward,
            dtype=dtype,
            batch=batch,
            heads=heads,
            head_dim=head_dim,
            pattern=pattern,
            feature_map=feature_map,
            repeats=repeats,
            memory=memory,
            progress=_measuring(say),
        )
    title = (
        f"attention {'forward + backward' if backward else 'forward'}: batch {batch}, {heads} heads, "
        f"head dim {head_dim}, {dtype}{', causal' if causal else ''}{f', pattern {pattern}' if pattern else ''}"
    )
    t = Table(title=title)
    cols: tuple[tuple[str, Literal["left", "right"]], ...] = (
        ("seq len", "right"),
        ("backend", "left"),
        ("median time", "right"),
        ("peak extra memory", "right"),
        ("time / sdpa", "right"),
        ("note", "left"),
    )
    for col, just in cols:
        t.add_column(col, justify=just)
    notes: dict[str, int] = {}  # full reason -> its number under the table
    for r in rows:
        note = ""
        if r["reason"]:
            k = notes.setdefault(r["reason"], len(notes) + 1)
            note = f"[{k}]"
        if r["status"] == "skipped":
            t.add_row(str(r["seq_len"]), r["backend"], "-", "-", "-", f"[yellow]skipped[/] {note}")
            continue
        mem = human_bytes(r["peak_extra_bytes"]) if r["peak_extra_bytes"] is not None else "-"
        ratio = f"{r['ratio_to_sdpa']:.2f}" if r["ratio_to_sdpa"] is not None else "-"
        t.add_row(str(r["seq_len"]), r["backend"], f"{r['median_s'] * 1e3:.1f} ms", mem, ratio, note)
    console.print(t)
    console.print(
        "time / sdpa: median time over torch SDPA's median in the same run (below 1: faster than SDPA)",
        highlight=False,
        soft_wrap=True,
    )
    for reason, k in notes.items():
        console.print(f"[yellow]\\[{k}] {_gist(reason)}:[/] {reason}", highlight=False, soft_wrap=True)
    if json_file is not None:
        write_json(json_file, rows, indent=2)  # a list of rows, as always (no envelope: readers index it)
        console.print(f"wrote {json_file}")
