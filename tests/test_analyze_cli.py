"""`headlab analyze` and `headlab demo` on the command line: the report, the summary, and every bad
input as one line on stderr with exit code 2."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from typer.testing import CliRunner

import headlab
from headlab.cli.main import app  # importing main registers every command
from headlab.errors import CLI_EXIT_CODE
from headlab.testing import run_cli as run_main

TEXT = "The cat sat on the mat because it was tired."


@pytest.fixture(scope="module")
def minilm():
    return headlab.load("minilm")


@pytest.fixture
def cached_load(minilm, monkeypatch):
    """`minilm` loads once per module; any other name goes to the real loader (and its errors)."""
    real = headlab.load

    def load(name="minilm", **kw):
        return minilm if str(name) == "minilm" else real(name, **kw)

    monkeypatch.setattr(headlab, "load", load)


def test_help_lists_the_options():
    res = CliRunner().invoke(app, ["analyze", "--help"])
    assert res.exit_code == 0
    for opt in ("--model", "--out", "--backend", "--force", "--heads", "--truncate", "--max-full-tokens"):
        assert opt in res.output


def test_analyze_writes_report_and_summary(cached_load, tmp_path, capsys):
    out = tmp_path / "rep"
    code, stdout, stderr = run_main(["analyze", TEXT, "--out", out, "--max-full-tokens", "4", "--heads", "0.2"], capsys)
    assert code == 0, stderr
    assert sorted(p.name for p in out.iterdir()) == ["heads.csv", "heads.json", "layer_00.png", "report.html"]
    assert f"report: {out}/" in stdout and "mode streaming" in stdout
    assert "note: long input: 13 tokens > 4" in stdout and "drawn only for heads 0.2" in stdout
    assert "0.2   previous-token: 100% of rows" in stdout  # the summary names an interesting head
    assert "capturing" not in stderr and "streaming statistics" in stderr and "writing the page" in stderr
    # again without --force: refused; with --force and --json: replaced, machine-readable summary
    code, _, stderr = run_main(["analyze", TEXT, "--out", out], capsys)
    assert code == CLI_EXIT_CODE and "--force" in stderr
    code, stdout, _ = run_main(["analyze", TEXT, "--out", out, "--force", "--json", "--max-full-tokens", "4",
                                "--heads", "1.8,0.2", "--backend", "sdpa"], capsys)
    assert code == 0
    js = json.loads(stdout)
    assert js["mode"] == "streaming" and js["drawn"] == ["1.8", "0.2"] and js["interesting"]["previous-token"] == "0.2"
    assert json.loads((out / "heads.json").read_text())["backend"] == "sdpa"


def test_demo(cached_load, tmp_path, capsys):
    code, stdout, stderr = run_main(["demo", "--out", tmp_path / "demo"], capsys)
    assert code == 0, stderr
    assert "mode full" in stdout and "report.html in a browser" in stdout
    assert len(list((tmp_path / "demo").glob("layer_*.png"))) == 6


@dataclass(frozen=True)
class BadCli:
    name: str
    args: tuple
    match: str


def _not_a_model(tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    (d / "notes.txt").write_text("not a model")
    return d


def _unsupported(tmp_path):
    d = tmp_path / "t5"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 16, "num_layers": 1, "num_heads": 2}))
    return d


def _busy(tmp_path):
    d = tmp_path / "busy"
    d.mkdir()
    (d / "keep.txt").write_text("x")
    return d


BAD_CLI = [
    BadCli("empty text", ("analyze", "  "), "empty"),
    BadCli("unknown model", ("analyze", TEXT, "--model", "gpt-17"), "known names: minilm"),
    BadCli("not a model folder", ("analyze", TEXT, "--model", _not_a_model), "not a Hugging Face model folder"),
    BadCli("unsupported architecture", ("analyze", TEXT, "--model", _unsupported), "t5"),
    BadCli("text too long", ("analyze", "word " * 600), "at most 512"),
    BadCli("busy output folder", ("analyze", TEXT, "--out", _busy), "not empty"),
    BadCli("unknown backend", ("analyze", TEXT, "--backend", "warp"), "warp"),
    BadCli("bad heads", ("analyze", TEXT, "--heads", "7.0"), "does not exist"),
]


@pytest.mark.parametrize("case", BAD_CLI, ids=lambda c: c.name)
def test_bad_input_is_one_line_exit_2(case, cached_load, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out lands here
    args = [a(tmp_path) if callable(a) else a for a in case.args]
    if "--out" not in args:
        args += ["--out", tmp_path / "out"]
    code, stdout, stderr = run_main(args, capsys)
    assert code == CLI_EXIT_CODE, (stdout, stderr)
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]), stderr  # one line, the last
    assert case.match in errors[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
