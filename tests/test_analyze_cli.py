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
from conftest import run_cli as run_main

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


def _a_file(tmp_path):
    f = tmp_path / "report.txt"
    f.write_text("x")
    return f


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
    BadCli("out under /proc", ("analyze", TEXT, "--out", "/proc/headlab-report"), "under /proc"),
    BadCli("out under /sys", ("analyze", TEXT, "--out", "/sys/kernel/headlab-report"), "under /sys"),
    BadCli("out is a file", ("analyze", TEXT, "--out", _a_file), "is a file"),
    # bytes that are not UTF-8 reach Python's argv as surrogate escapes (b"caf\xe9 \xff")
    BadCli("not UTF-8", ("analyze", "caf\udce9 \udcff"), "not valid UTF-8: byte 0xe9 at byte 3 of 6"),
    BadCli("bad memory limit", ("analyze", TEXT), "HEADLAB_MEMORY_LIMIT='10 GiBs'"),
]


@pytest.mark.parametrize("case", BAD_CLI, ids=lambda c: c.name)
def test_bad_input_is_one_line_exit_2(case, cached_load, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out lands here
    if case.name == "bad memory limit":
        monkeypatch.setenv("HEADLAB_MEMORY_LIMIT", "10 GiBs")
    args = [a(tmp_path) if callable(a) else a for a in case.args]
    if "--out" not in args:
        args += ["--out", tmp_path / "out"]
    code, stdout, stderr = run_main(args, capsys)
    assert code == CLI_EXIT_CODE, (stdout, stderr)
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]), stderr  # one line, the last
    assert case.match in errors[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_not_utf8_from_a_real_command_line(tmp_path):
    """The bytes as a shell passes them, through the console script: one line, exit 2, nothing loaded."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "headlab.cli.main", "analyze", b"caf\xe9 \xff", "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert res.returncode == CLI_EXIT_CODE
    assert res.stderr.strip().splitlines() == [
        "error: the text is not valid UTF-8: byte 0xe9 at byte 3 of 6; convert it first, e.g. iconv -f latin1 -t utf-8"]
    assert not (tmp_path / "out").exists()


def test_unwritable_out_dir_is_refused_before_loading(cached_load, tmp_path, capsys, monkeypatch):
    """A folder that takes no file is found by writing one there, before the model is loaded."""
    import tempfile

    loads = []
    monkeypatch.setattr(headlab, "load", lambda *a, **k: loads.append(a))

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)  # what a read-only folder does, also for root
    code, _, stderr = run_main(["analyze", TEXT, "--out", tmp_path / "ro"], capsys)
    assert code == CLI_EXIT_CODE and not loads
    assert stderr.strip().splitlines() == [f"error: cannot write the report into '{tmp_path / 'ro'}': Permission "
                                           "denied; choose a writable folder with --out"]


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root writes into read-only folders; the refusal is tested with a refusing probe above")
def test_read_only_out_dir(cached_load, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, _, stderr = run_main(["analyze", TEXT, "--out", ro], capsys)
    finally:
        ro.chmod(0o755)
    assert code == CLI_EXIT_CODE and "cannot write the report" in stderr


def test_approximate_backend_is_named_in_the_report(cached_load, tmp_path, capsys):
    """--backend linear: heads.json and the page say which backend ran and what the table shows."""
    out = tmp_path / "lin"
    code, stdout, stderr = run_main(["analyze", TEXT, "--out", out, "--backend", "linear", "--max-full-tokens", "4",
                                     "--heads", "0.2"], capsys)
    assert code == 0, stderr
    js = json.loads((out / "heads.json").read_text())
    assert js["backend"] == "linear" and js["model_backend"] == "linear" and js["model_backend_exact"] is False
    assert "streaming" in js["statistics"] and "'linear'" in js["statistics"]
    assert any("is approximate" in n for n in js["notes"])
    assert "note: backend 'linear' is approximate" in stdout
    page = (out / "report.html").read_text()
    assert "backend: linear (approximate)" in page and "is approximate (not softmax attention)" in page
    # short input: every map is captured on the reference computation, and the report says linear was not used
    code, stdout, _ = run_main(["analyze", TEXT, "--out", tmp_path / "lin2", "--backend", "linear"], capsys)
    assert code == 0 and "was not used" in stdout
    js = json.loads((tmp_path / "lin2" / "heads.json").read_text())
    assert js["model_backend_exact"] is False and "reference computation" in js["statistics"]
