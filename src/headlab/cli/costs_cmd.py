"""``headlab memory``: what attention costs for a shape, on every backend."""

from __future__ import annotations

from typing import Literal

import typer
from rich.table import Table

from headlab.cli.app import app, console, human_bytes, human_flops, print_json
from headlab.errors import ConfigError, CostModelError


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
    pattern: str = typer.Option(
        None, "--pattern", help="a sparse pattern, e.g. sliding_window:256 (see headlab pattern)"
    ),
    ranks: int = typer.Option(None, "--ranks", help="also cost ring attention with the sequence sharded over R ranks"),
    ring: bool = typer.Option(
        False, "--ring", help="ring attention (the sequence-parallel strategy --ranks costs; implied)"
    ),
    link_bandwidth: float = typer.Option(
        None, "--link-bandwidth", help="bytes/s between ranks, e.g. 50e9, for the compute-to-communication ratio"
    ),
    peak_flops: float = typer.Option(
        None, "--peak-flops", help="FLOP/s one rank sustains, e.g. 395e12, for that ratio"
    ),
    kv_policy: str = typer.Option(
        None,
        "--kv-policy",
        help="also predict the KV cache a decoder holds at --seq-len "
        "tokens under a per-head policy: full, streaming:SINK,RECENT, or a policy JSON file",
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object, an entry per backend"),
) -> None:
    """Predicted memory and FLOPs of attention for a shape, for every backend.

    Example (the seed text's 32 GB): headlab memory --seq-len 4096 --heads 32 --layers 32 --dtype float16

    With --kv-policy, the KV cache too: headlab memory -n 8192 --layers 30 --heads 9 --kv-heads 3 --head-dim 64
    --dtype float32 --kv-policy streaming:4,256

    With --pattern every backend is costed for that mask; the tiled and sparse backends count exactly the
    tiles of the pattern's block map they visit, in closed form for the built-in patterns (any length).
    """
    from headlab import costs  # here, not above: `headlab --help` imports no command's library
    from headlab.attention import backends as _backends
    from headlab.spec.masks import from_string

    if ring and ranks is None:
        raise ConfigError("--ring costs attention sharded over ranks: give --ranks R too")
    if ranks is not None and ranks < 1:
        raise ConfigError(f"--ranks must be at least 1, got {ranks}")
    if ranks is not None and seq_len > 0 and seq_len % ranks:
        # ring attention gives each rank an equal shard; a floor would cost a shorter sequence than the one asked for
        raise ConfigError(
            f"--seq-len {seq_len} does not split into {ranks} equal shards for --ranks {ranks}; give a "
            f"multiple of {ranks}, e.g. --seq-len {max(ranks, seq_len // ranks * ranks)}"
        )
    if (link_bandwidth is None) != (peak_flops is None):
        raise ConfigError("the compute-to-communication ratio needs both --link-bandwidth and --peak-flops")
    for name, val in (("--link-bandwidth", link_bandwidth), ("--peak-flops", peak_flops)):
        if val is not None and not 0 < val < float("inf"):  # inf would print a ratio of inf or 0 as if measured
            raise ConfigError(f"{name} must be a positive number, got {val}")
    if kv_policy is not None and not kv_policy.strip():
        raise ConfigError("--kv-policy is empty; give a rule such as streaming:4,256, or a policy JSON file")
    shape = costs.AttentionShape(
        heads=heads,
        q_len=seq_len,
        batch=batch,
        kv_heads=kv_heads,
        kv_len=kv_len,
        head_dim=head_dim,
        layers=layers,
        dtype=dtype,
        causal=causal,
        mask=from_string(pattern) if pattern is not None else None,
    )
    cache = _kv_cache(shape, kv_policy) if kv_policy is not None else None
    table, refused = {}, {}
    for name in _backends.names():
        try:
            table[name] = costs.estimate(shape, name)
        except CostModelError as e:  # a pattern whose tiles cannot be counted at this length
            refused[name] = str(e)
    plan = _ring_plan(shape, ranks, link_bandwidth, peak_flops) if ranks is not None else None
    if as_json:
        print_json(
            {
                **{name: c.as_dict() for name, c in table.items()},
                **{name: {"backend": name, "refused": why} for name, why in refused.items()},
                **({"ring": plan} if plan is not None else {}),
                **({"kv_cache": cache} if cache is not None else {}),
            }
        )
        return
    t = Table(
        title=(
            f"attention cost: batch {shape.batch}, {shape.heads} heads ({shape.kv_heads} kv), "
            f"{shape.q_len}x{shape.kv_len}, head dim {shape.head_dim}, {shape.layers} layers, "
            f"{str(shape.dtype).removeprefix('torch.')}{', causal' if causal else ''}"
            f"{f', pattern {pattern}' if pattern is not None else ''}"
        )
    )
    cols: tuple[tuple[str, Literal["left", "right"]], ...] = (
        ("backend", "left"),
        ("weights held\n(all layers)", "right"),
        ("working set\n(one layer)", "right"),
        ("forward", "right"),
        ("backward", "right"),
    )
    for col, just in cols:
        t.add_column(col, justify=just, no_wrap=True)
    for name, c in table.items():
        t.add_row(
            name,
            human_bytes(c.attention_weights_bytes),
            human_bytes(c.working_set_bytes),
            human_flops(c.forward_flops),
            human_flops(c.backward_flops),
        )
    for name in refused:
        t.add_row(name, "-", "-", "-", "-")
    console.print(t)
    for name, c in table.items():
        if c.notes:
            console.print(f"  {name}: {c.notes}", highlight=False)
    for name, why in refused.items():
        console.print(f"  [yellow]{name}: not predicted:[/] {why}", highlight=False)
    if plan is not None:
        _print_ring(plan)
    if cache is not None:
        from headlab.decode.instrument import kv_heads_text

        console.print(
            f"KV cache at {cache['tokens']} tokens ({shape.layers} layers x {shape.kv_heads} kv heads): "
            f"full {human_bytes(cache['full_bytes'])}, policy {cache['policy']} "
            f"{human_bytes(cache['policy_bytes'])} ({cache['ratio']:.1%}; {kv_heads_text(cache['heads'])})",
            highlight=False,
        )


def _kv_cache(shape, text: str) -> dict:
    """The KV cache a decoder of ``shape`` holds at ``shape.kv_len`` tokens: full, and under the policy ``text``."""
    from pathlib import Path

    from headlab.costs.kv import full_cache_bytes, policy_cache_bytes
    from headlab.decode import kv  # here: the KV policies import transformers, which `memory` alone never needs

    if text.endswith(".json") or Path(text).exists():  # a policy file: missing, a folder, not UTF-8, empty
        from headlab.cli.app import read_text_file

        read_text_file(Path(text), "--kv-policy", what="a policy JSON file or a rule such as streaming:4,256")
        policy = kv.Policy.load(text)
    else:
        policy = kv.Policy.parse(text)
    kvh = [shape.kv_heads] * shape.layers
    policy.check(kvh, model=f"--layers {shape.layers} --kv-heads {shape.kv_heads}")
    args = dict(tokens=shape.kv_len, head_dim=shape.head_dim, v_dim=shape.v_dim, dtype=shape.dtype, batch=shape.batch)
    full = full_cache_bytes(layers=shape.layers, kv_heads=shape.kv_heads, **args)
    held = policy_cache_bytes(policy, kv_heads=kvh, **args)
    return {
        "tokens": shape.kv_len,
        "policy": policy.name,
        "full_bytes": full,
        "policy_bytes": held,
        "ratio": held / full,
        "heads": policy.counts(kvh),
    }


def _ring_plan(shape, ranks: int, link_bandwidth: float | None, peak_flops: float | None) -> dict:
    from headlab import costs
    from headlab.costs.ring import ring_cost

    c = ring_cost(shape, ranks)
    plan = c.as_dict()
    if link_bandwidth is not None:
        hw = costs.Hardware("per rank", peak_flops=peak_flops, bandwidth=link_bandwidth)  # type: ignore[arg-type]  # only its bandwidth is read: peak_flops may be None
        plan["link_bandwidth"] = link_bandwidth
        plan["peak_flops"] = peak_flops
        plan["compute_to_communication_forward"] = c.compute_to_communication(hw, link_bandwidth)
        plan["compute_to_communication_backward"] = c.compute_to_communication(hw, link_bandwidth, backward=True)
    return plan


def _print_ring(plan: dict) -> None:
    t = Table(title=f"ring attention on {plan['ranks']} ranks ({plan['shard_len']} positions each), per rank and layer")
    for col in ("shard", "working set", "sent fwd", "sent bwd", "fwd FLOP", "bwd FLOP"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_row(
        human_bytes(plan["shard_bytes"]),
        human_bytes(plan["working_set_bytes"]),
        human_bytes(plan["sent_forward_bytes"]),
        human_bytes(plan["sent_backward_bytes"]),
        human_flops(plan["forward_flops_per_rank"]),
        human_flops(plan["backward_flops_per_rank"]),
    )
    console.print(t)
    if "compute_to_communication_forward" in plan:
        console.print(
            f"  compute / communication per step: forward {plan['compute_to_communication_forward']:.2f}, "
            f"backward {plan['compute_to_communication_backward']:.2f} (above 1: the transfer hides "
            "behind the work)",
            highlight=False,
        )
