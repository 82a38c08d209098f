"""``headlab bench attention``: help, a tiny run (table, JSON, skipped rows), bad arguments."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli as _run


def test_help(capsys):
    code, out, _ = _run(["bench", "attention", "--help"], capsys)
    assert code == 0
    for opt in ("--seq-lens", "--backends", "--causal", "--backward", "--json", "--pattern", "--feature-map"):
        assert opt in out


def test_tiny_run_table_and_json(tmp_path, capsys):
    path = tmp_path / "rows.json"
    code, out, _ = _run(["bench", "attention", "--seq-lens", "64,128", "--backends", "sdpa,tiled,reference",
                         "--causal", "--backward", "--repeats", "1", "--heads", "2", "--head-dim", "16",
                         "--json", str(path)], capsys)
    assert code == 0, out
    assert "time / sdpa" in out and "tiled" in out
    rows = json.loads(path.read_text())
    assert [(r["seq_len"], r["backend"]) for r in rows] == [
        (64, "sdpa"), (64, "tiled"), (64, "reference"), (128, "sdpa"), (128, "tiled"), (128, "reference")]
    for r in rows:
        assert r["status"] == "ok" and r["median_s"] > 0 and r["causal"] and r["backward"]
        assert r["peak_extra_bytes"] is not None and r["peak_extra_bytes"] >= 0
        assert r["ratio_to_sdpa"] == pytest.approx(r["median_s"] / r["sdpa_median_s"])
    assert [r["ratio_to_sdpa"] for r in rows if r["backend"] == "sdpa"] == [1.0, 1.0]


def test_memory_guard_refusal_is_a_skipped_row(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HEADLAB_MEMORY_LIMIT", str(3 * 2**20))  # 3 MiB: the reference's map does not fit
    path = tmp_path / "rows.json"
    code, out, _ = _run(["bench", "attention", "--seq-lens", "512", "--backends", "sdpa,reference",
                         "--repeats", "1", "--no-memory", "--json", str(path)], capsys)
    assert code == 0
    rows = {r["backend"]: r for r in json.loads(path.read_text())}
    assert rows["sdpa"]["status"] == "ok"
    assert rows["reference"]["status"] == "skipped" and "needs about" in rows["reference"]["reason"]
    assert "skipped" in out


def test_pattern_and_feature_map(tmp_path, capsys):
    """--pattern reaches every backend (and the memory-measuring process); --feature-map configures linear."""
    path = tmp_path / "rows.json"
    code, out, _ = _run(["bench", "attention", "--seq-lens", "256", "--backends", "sdpa,sparse,tiled",
                         "--pattern", "sliding_window:16&causal", "--repeats", "1", "--heads", "2",
                         "--head-dim", "16", "--json", str(path)], capsys)
    assert code == 0, out
    rows = json.loads(path.read_text())
    assert {r["backend"] for r in rows} == {"sdpa", "sparse", "tiled"}
    for r in rows:
        assert r["status"] == "ok" and r["pattern"] == "sliding_window:16&causal", r
        assert r["peak_extra_bytes"] is not None, r
    code, out, _ = _run(["bench", "attention", "--seq-lens", "128", "--backends", "sdpa,linear",
                         "--feature-map", "favor:32", "--repeats", "1", "--heads", "2", "--head-dim", "16",
                         "--no-memory", "--json", str(path), "--force"], capsys)  # replaces the first rows
    assert code == 0, out
    rows = {r["backend"]: r for r in json.loads(path.read_text())}
    assert rows["linear"]["status"] == "ok" and rows["linear"]["median_s"] > 0


BAD = [
    ("letters in --seq-lens", ["--seq-lens", "64,x"], "--seq-lens"),
    ("unknown pattern", ["--seq-lens", "64", "--pattern", "zigzag:3"], "zigzag"),
    ("bad feature map", ["--seq-lens", "64", "--backends", "sdpa,linear", "--feature-map", "favor:0"], "num_features=0"),
    ("unknown backend", ["--seq-lens", "64", "--backends", "sdpa,nope"], "unknown backend"),
    ("zero repeats", ["--seq-lens", "64", "--repeats", "0"], "repeats must be an integer >= 1, got 0"),
    ("zero heads", ["--seq-lens", "64", "--heads", "0"], "heads must be an integer >= 1, got 0"),
    ("zero batch", ["--seq-lens", "64", "--batch", "0"], "batch must be an integer >= 1"),
    ("json in a missing folder", ["--seq-lens", "64", "--json", "/nonexistent/dir/x.json"], "does not exist"),
    ("json under /proc", ["--seq-lens", "64", "--json", "/proc/headlab-x.json"], "cannot be written"),
    ("empty pattern", ["--seq-lens", "64", "--pattern", ""], "non-empty"),
]


@pytest.mark.parametrize("name,args,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_argument_exit_2_one_line(name, args, needle, capsys, monkeypatch):
    import headlab.attention.measure as measure

    ran = []
    monkeypatch.setattr(measure, "_call", lambda *a, **k: ran.append(a))
    code, _, err = _run(["bench", "attention", "--no-memory", "--repeats", "1", *args], capsys)
    assert not ran  # refused before anything was timed
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], err


def test_guard_refusals_known_before_anything_runs(capsys, monkeypatch):
    """200,000 tokens on the reference backend: refused up front, and no hidden SDPA baseline is run."""
    import headlab.attention.measure as measure

    ran = []
    monkeypatch.setattr(measure, "_call", lambda *a, **k: ran.append(a))
    code, out, err = _run(["bench", "attention", "--seq-lens", "200000", "--backends", "reference", "--no-memory"],
                          capsys)
    assert code == 0, err
    assert ran == []
    assert "skipped [1]" in out and "[1] skipped, does not fit in memory: backend 'reference'" in out


def test_long_skip_reasons_are_short_in_the_table(capsys, monkeypatch):
    monkeypatch.setenv("HEADLAB_MEMORY_LIMIT", "3M")
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = _run(["bench", "attention", "--seq-lens", "512,1024", "--backends", "sdpa,reference",
                         "--repeats", "1", "--no-memory", "--heads", "2", "--head-dim", "16"], capsys)
    assert code == 0
    table = out[:out.index("time / sdpa: ")]
    rows = [ln for ln in table.splitlines() if "reference" in ln or "skipped" in ln]
    assert len(rows) == 2, table  # one line per refused row: the reason does not wrap in its cell
    below = out[out.index("time / sdpa: "):]
    assert "[1] skipped, does not fit in memory: backend 'reference' at 512x512" in below
    assert "[2] skipped, does not fit in memory: backend 'reference' at 1024x1024" in below
    assert "use backend='sdpa'" in below  # the full reason, once, under the table
