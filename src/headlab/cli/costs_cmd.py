"""``headlab memory``: what attention costs for a shape, on every backend."""

from __future__ import annotations

import typer
from rich.table import Table

from headlab import costs
from headlab.attention import backends as _backends
from headlab.attention.masks import from_string
from headlab.cli.app import app, console, human_bytes, human_flops, print_json
from headlab.errors import CostModelError


@app.command()
def memory(
    seq_len: int = typer.Option(4096, "--seq-len", "-n", help="query positions (and key positions unless --kv-len)"),
    heads: int = typer.Option(32, "--heads", help="query heads"),
    layers: int = typer.Option(1, "--layers", help="attention layers in the stack"),
    dtype: str = typer.Option("float16", "--dtype", help="float16, bfloat16, float32 or float64"),
    batch: int = typer.Option(1, "--batch"),
    kv_heads: int = typer.Option(None, "--kv-heads", help="key/value heads (grouped-query); default --heads"),
    kv_len: int = typer.Option(None, "--kv-len", help="key positions; default --seq-len"),
    head_dim: int = typer.Option(128, "--head-dim"),
    causal: bool = typer.Option(False, "--causal"),
    pattern: str = typer.Option(None, "--pattern", help="a sparse pattern, e.g. sliding_window:256 (see headlab pattern)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object, an entry per backend"),
) -> None:
    """Predicted memory and FLOPs of attention for a shape, for every backend.

    Example (the seed text's 32 GB): headlab memory --seq-len 4096 --heads 32 --layers 32 --dtype float16

    With --pattern every backend is costed for that mask; the tiled and sparse backends count exactly the
    tiles of the pattern's block map they visit, in closed form for the built-in patterns (any length).
    """
    shape = costs.AttentionShape(heads=heads, q_len=seq_len, batch=batch, kv_heads=kv_heads, kv_len=kv_len,
                                 head_dim=head_dim, layers=layers, dtype=dtype, causal=causal,
                                 mask=from_string(pattern) if pattern is not None else None)
    table, refused = {}, {}
    for name in _backends.names():
        try:
            table[name] = costs.estimate(shape, name)
        except CostModelError as e:  # a pattern whose tiles cannot be counted at this length
            refused[name] = str(e)
    if as_json:
        print_json({**{name: c.as_dict() for name, c in table.items()},
                    **{name: {"backend": name, "refused": why} for name, why in refused.items()}})
        return
    t = Table(title=(f"attention cost: batch {shape.batch}, {shape.heads} heads ({shape.kv_heads} kv), "
                     f"{shape.q_len}x{shape.kv_len}, head dim {shape.head_dim}, {shape.layers} layers, "
                     f"{str(shape.dtype).removeprefix('torch.')}{', causal' if causal else ''}"
                     f"{f', pattern {pattern}' if pattern is not None else ''}"))
    for col, just in (("backend", "left"), ("weights held\n(all layers)", "right"),
                      ("working set\n(one layer)", "right"), ("forward", "right"), ("backward", "right")):
        t.add_column(col, justify=just, no_wrap=True)
    for name, c in table.items():
        t.add_row(name, human_bytes(c.attention_weights_bytes), human_bytes(c.working_set_bytes),
                  human_flops(c.forward_flops), human_flops(c.backward_flops))
    for name in refused:
        t.add_row(name, "-", "-", "-", "-")
    console.print(t)
    for name, c in table.items():
        if c.notes:
            console.print(f"  {name}: {c.notes}", highlight=False)
    for name, why in refused.items():
        console.print(f"  [yellow]{name}: not predicted:[/] {why}", highlight=False)
