"""``headlab demo``: a first look (replaced by the real-model report once that lands)."""

from __future__ import annotations

import torch
import typer

import headlab
from headlab import costs
from headlab.cli.app import app, console, human_bytes


@app.command()
def demo(out: str = typer.Option("headlab-report", "--out", help="report folder")) -> None:
    """A first look: the seed text's cost, and attention computed two ways."""
    seed = costs.AttentionShape(heads=32, q_len=4096, layers=32, dtype="float16")
    for name, c in costs.estimate_all(seed).items():
        console.print(f"{name:>10}: attention weights {human_bytes(c.attention_weights_bytes)}, "
                      f"working set {human_bytes(c.working_set_bytes)}")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 64, 32, generator=g)
    k = torch.randn(1, 2, 64, 32, generator=g)
    v = torch.randn(1, 2, 64, 32, generator=g)
    ref = headlab.attention(q, k, v, causal=True, backend="reference")
    fast = headlab.attention(q, k, v, causal=True)
    console.print(f"auto vs reference, 4 query heads / 2 kv heads, causal: max |diff| = {(ref - fast).abs().max():.2e}")
