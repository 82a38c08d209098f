"""``headlab bench attention``: help, a tiny run (table, JSON, skipped rows), bad arguments."""

from __future__ import annotations

import json

import pytest

from headlab.testing import run_cli as _run


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
    assert "ratio to sdpa" in out and "tiled" in out
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
                         "--no-memory", "--json", str(path)], capsys)
    assert code == 0, out
    rows = {r["backend"]: r for r in json.loads(path.read_text())}
    assert rows["linear"]["status"] == "ok" and rows["linear"]["median_s"] > 0


BAD = [
    ("letters in --seq-lens", ["--seq-lens", "64,x"], "--seq-lens"),
    ("unknown pattern", ["--seq-lens", "64", "--pattern", "zigzag:3"], "zigzag"),
    ("bad feature map", ["--seq-lens", "64", "--backends", "sdpa,linear", "--feature-map", "favor:0"], "num_features=0"),
    ("unknown backend", ["--seq-lens", "64", "--backends", "sdpa,nope"], "unknown backend"),
]


@pytest.mark.parametrize("name,args,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_argument_exit_2_one_line(name, args, needle, capsys):
    code, _, err = _run(["bench", "attention", "--no-memory", "--repeats", "1", *args], capsys)
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], err
