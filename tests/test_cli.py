"""The command line: --help of every command, `memory` and `backends`, the error rule (one line, exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from headlab.cli.main import app  # importing main registers every command
from conftest import run_cli as run_main

runner = CliRunner()


def _commands(typer_app, prefix=()):
    import typer.main

    group = typer.main.get_command(typer_app)
    stack = [(prefix, group)]
    while stack:
        path, cmd = stack.pop()
        yield path
        for name, sub in getattr(cmd, "commands", {}).items():
            stack.append((path + (name,), sub))


def test_every_command_has_help():
    paths = list(_commands(app))
    assert ("memory",) in paths and ("backends",) in paths
    for path in paths:
        res = runner.invoke(app, [*path, "--help"])
        assert res.exit_code == 0, (path, res.output)
        assert "Usage" in res.output


def test_memory_json_reproduces_the_seed(capsys):
    code, out, _ = run_main(["memory", "--seq-len", "4096", "--heads", "32", "--layers", "32",
                             "--dtype", "float16", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["reference"]["attention_weights_bytes"] == 34_359_738_368
    for name, entry in data.items():
        for key in ("attention_weights_bytes", "working_set_bytes", "forward_flops"):
            assert key in entry, (name, key)


def test_memory_table_in_human_units(capsys):
    code, out, _ = run_main(["memory", "--seq-len", "4096", "--heads", "32", "--layers", "32", "--dtype", "float16"],
                            capsys)
    assert code == 0
    assert "32.0 GiB" in out and "TFLOP" in out


def test_memory_with_a_pattern_counts_the_visited_tiles(capsys):
    code, out, _ = run_main(["memory", "--seq-len", "4096", "--heads", "8", "--head-dim", "64", "--dtype", "float32",
                             "--pattern", "sliding_window:256", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    from headlab import costs, masks

    shape = costs.AttentionShape(heads=8, q_len=4096, head_dim=64, mask=masks.sliding_window(256))
    assert data["sparse"]["forward_flops"] == costs.estimate(shape, "sparse").forward_flops
    assert data["sparse"]["forward_flops"] < data["sdpa"]["forward_flops"] / 5
    # sdpa materialises the (head-independent) pattern once: 4096^2 booleans, not 8 x that
    assert 4096**2 <= data["sdpa"]["working_set_bytes"] < 2 * 4096**2


def test_backends_lists_the_registry(capsys):
    code, out, _ = run_main(["backends", "--json"], capsys)
    assert code == 0
    rows = json.loads(out)
    names = [r["name"] for r in rows]
    assert names[0] == "sdpa" and "reference" in names
    ref = next(r for r in rows if r["name"] == "reference")
    assert ref["returns_weights"] and "float64" in ref["dtypes"]


@pytest.mark.parametrize("args,needle", [
    (["memory", "--dtype", "int8"], "unknown dtype 'int8'"),
    (["memory", "--heads", "6", "--kv-heads", "4"], "multiple of kv_heads"),
    (["memory", "--seq-len", "0"], "must be a positive integer"),
    (["memory", "--pattern", ""], "a mask spec must be a non-empty string"),
    (["memory", "--pattern", "bigbird:64", "--seq-len", "1000000000", "--json"], None),  # random blocks: refused
])
def test_errors_are_one_line_and_exit_2(args, needle, capsys):
    if needle is None:  # a pattern whose tiles cannot be counted at this length: the other backends still are
        code, out, err = run_main(args, capsys)
        table = json.loads(out)
        assert code == 0 and "tiles of 128x128" in table["sparse"]["refused"] and table["sdpa"]["forward_flops"] > 0
        return
    code, out, err = run_main(args, capsys)
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_console_script_exit_code():
    res = subprocess.run([sys.executable, "-m", "headlab.cli.main", "memory", "--dtype", "int8"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error:")


@pytest.mark.parametrize("value", ["garbage", "10 apples", "-5G", "1.5.2G", "Gi"])
def test_bad_memory_limit_is_one_line_naming_the_variable(value, capsys, monkeypatch):
    monkeypatch.setenv("HEADLAB_MEMORY_LIMIT", value)
    code, out, err = run_main(["memory"], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "HEADLAB_MEMORY_LIMIT" in err and repr(value) in err


@pytest.mark.parametrize("value,expected", [("10GiB", 10 * 2**30), ("512M", 512 * 2**20), ("1.5G", 3 * 2**29),
                                            ("4096", 4096), ("64kb", 64 * 1024), (" 2 TiB ", 2 * 2**40)])
def test_memory_limit_in_human_units(value, expected, monkeypatch):
    from headlab.spec.memory_guard import available_memory

    monkeypatch.setenv("HEADLAB_MEMORY_LIMIT", value)
    assert available_memory() == expected


def test_memory_at_a_trillion_tokens(capsys):
    code, out, err = run_main(["memory", "--seq-len", str(10**12), "--causal", "--pattern", "sliding_window:256",
                               "--json"], capsys)
    assert code == 0, err
    table = json.loads(out)
    n_b = 10**12 // 128
    # offsets 0..256 reach the diagonal tile and the two left of it: 3 a row, rows 0 and 1 have 1 and 2
    assert table["sparse"]["notes"].startswith(f"{32 * (3 * n_b - 3):,} of")
    assert "block map alone would take" in table["sparse"]["notes"]


def test_memory_with_ranks_costs_ring_attention(capsys):
    code, out, _ = run_main(["memory", "--seq-len", "1000000", "--heads", "32", "--head-dim", "128", "--dtype",
                             "bfloat16", "--causal", "--ranks", "64", "--ring", "--link-bandwidth", "50e9",
                             "--peak-flops", "395e12", "--json"], capsys)
    assert code == 0
    ring = json.loads(out)["ring"]
    block = 32 * 15625 * 256 * 2  # kv heads x shard x (d + dv) x bytes: one K/V block
    assert ring["shard_len"] == 15625 and ring["sent_forward_bytes"] == 63 * block
    assert ring["sent_backward_bytes"] == 63 * block + 64 * 32 * 15625 * 256 * 4  # + dK/dV accumulators in float32
    assert 0.9 < ring["compute_to_communication_forward"] < 1.1
    code, out, _ = run_main(["memory", "--seq-len", "4096", "--ranks", "4"], capsys)
    assert code == 0 and "ring attention on 4 ranks" in out


@pytest.mark.parametrize("args, message", [
    (["--ring"], "give --ranks"),
    (["--ranks", "0"], "at least 1"),
    (["--ranks", "2", "--link-bandwidth", "1e9"], "both --link-bandwidth and --peak-flops"),
])
def test_memory_ring_bad_input(args, message, capsys):
    code, _, err = run_main(["memory", *args], capsys)
    assert code == 2 and message in err and err.count("\n") == 1
