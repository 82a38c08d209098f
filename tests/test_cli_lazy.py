"""The command line from the registry (issue 39): a toy instrument in this one file gets its command, ``--json``,
progress, its checks before the load, Ctrl-C with exit 130 and a resume line that works, ``--resume``, and its units
split across 2 gloo ranks under torchrun, with no other file touched; ``headlab --help`` and ``headlab memory``
import neither transformers (nor, for ``--help``, torch); the table read from the sources is the registry.

Run as a script (``python tests/test_cli_lazy.py ARGS``), this file registers the toy instrument and runs
``headlab ARGS``: the torchrun test starts it on two ranks.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from headlab.interpret.study.base import Instrument, InstrumentResult, Option, Output, Unit, at_least, register

STOP_AT = "HEADLAB_TOY_STOP_AT"  # the unit whose run raises KeyboardInterrupt (as Ctrl-C would)


class Toy(Instrument):
    """Count the words of each text (a toy instrument: the whole declaration of a command)."""

    name = "toy-words"
    summary = "Count the words of each text of --texts.\n\nExample: headlab toy-words --texts t.txt --out counts.json"
    options = (
        Option("model", "--model", str, "tiny", "the model (the toy's load hook counts loads)"),
        Option("texts", "--texts", Path, ..., "a file of texts, one per line", reads="texts"),
        Option("scale", "--scale", int, 1, "multiply every count", check=at_least(1)),
        Option("out", "--out", Path, None, "the result file", setting=False),
    )
    output = Output("out", folder=False)
    resumable = True
    stage = "texts"
    loads: list[str] = []
    calls: list[str] = []

    def load(self, ctx):
        Toy.loads.append(ctx.options["model"])
        return object()

    def units(self, ctx):
        return [Unit(str(i), t) for i, t in enumerate(ctx.data["texts"])]

    def run_unit(self, ctx, unit, recording=None):
        if os.environ.get(STOP_AT) == unit.key:
            raise KeyboardInterrupt
        Toy.calls.append(unit.key)
        return [len(unit.payload.split()) * ctx.options["scale"], ctx.rank]

    def finish(self, ctx, values):
        keys = sorted(values, key=int)
        return InstrumentResult(self.name, settings=ctx.settings,
                                figures={"words": [values[k][0] for k in keys], "ranks": [values[k][1] for k in keys]})

    def render(self, ctx, outcome, console, err):
        console.print("words: " + " ".join(map(str, outcome.result.figures["words"])))


@pytest.fixture
def toy(monkeypatch):
    register(Toy)
    Toy.loads, Toy.calls = [], []
    monkeypatch.delenv(STOP_AT, raising=False)
    monkeypatch.setenv("HEADLAB_PROGRESS", "plain")
    yield Toy
    from headlab.interpret.study.base import unregister

    unregister(Toy.name)


@pytest.fixture
def texts(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("the cat sat\na dog\none two three four\nfive\nsix seven\n")
    return path, [3, 2, 4, 1, 2]


def _run(argv, capsys):
    from headlab.cli.main import main

    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_a_toy_instrument_in_one_file_is_a_command_with_json_and_resume(toy, texts, tmp_path, capsys):
    path, words = texts
    code, out, _ = _run(["toy-words", "--help"], capsys)
    assert code == 0 and all(flag in out for flag in ("--texts", "--scale", "--out", "--json", "--resume")), out
    code, out, _ = _run(["--help"], capsys)
    assert code == 0 and "toy-words" in out and "Count the words of each text" in out
    code, out, err = _run(["toy-words", "--texts", str(path), "--out", str(tmp_path / "c.json")], capsys)
    assert code == 0 and out.strip() == "words: 3 2 4 1 2", (out, err)
    assert json.loads((tmp_path / "c.json").read_text())["words"] == words
    assert "texts" in err and "5/5" in err  # the runner's progress: the stage and done/total
    code, out, _ = _run(["toy-words", "--texts", str(path), "--scale", "2", "--json"], capsys)
    envelope = json.loads(out)
    assert code == 0 and envelope["headlab"]["kind"] == "toy-words" and envelope["words"] == [2 * w for w in words]


def test_the_toy_is_checked_before_its_load(toy, texts, tmp_path, capsys):
    path, _ = texts
    for argv, needle in ((["--scale", "0"], "--scale must be at least 1, got 0"),
                         (["--texts", str(tmp_path)], "is a folder"),
                         (["--out", str(tmp_path)], "--out")):
        args = ["toy-words", "--texts", str(path), *argv]
        code, out, err = _run(args, capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and needle in lines[0], (args, err)
    assert Toy.loads == []  # every refusal came before the load
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]  # and wrote nothing


def test_ctrl_c_exits_130_and_the_printed_line_resumes(toy, texts, tmp_path, capsys, monkeypatch):
    path, words = texts
    out_file = tmp_path / "c.json"
    monkeypatch.setenv(STOP_AT, "3")
    code, _, err = _run(["toy-words", "--texts", str(path), "--out", str(out_file)], capsys)
    line = [ln for ln in err.splitlines() if ln.startswith("interrupted")]
    assert code == 130 and len(line) == 1 and Toy.calls == ["0", "1", "2"], err
    command = line[0].split("to finish the rest: ", 1)[1]
    assert command.startswith("headlab toy-words ") and command.endswith(" --resume"), command
    monkeypatch.delenv(STOP_AT)
    Toy.calls[:] = []
    code, out, err = _run(shlex.split(command)[1:], capsys)  # the printed line, as a user would paste it
    assert code == 0 and Toy.calls == ["3", "4"] and out.strip() == "words: 3 2 4 1 2", err
    assert json.loads(out_file.read_text())["words"] == words


def test_a_second_run_on_the_same_output_is_refused(toy, texts, tmp_path, capsys):
    from headlab.locks import lock_path

    path, _ = texts
    out_file = tmp_path / "c.json"
    lock_path(out_file).write_text(str(os.getppid()))  # a live process holds it (this test's parent)
    code, _, err = _run(["toy-words", "--texts", str(path), "--out", str(out_file)], capsys)
    assert code == 2 and "is being written by another headlab run" in err and not out_file.exists()
    assert Toy.loads == []
    lock_path(out_file).write_text("999999999")  # a stale lock (no such process) is taken over
    code, _, err = _run(["toy-words", "--texts", str(path), "--out", str(out_file)], capsys)
    assert code == 0 and out_file.exists() and not lock_path(out_file).exists(), err


@pytest.mark.distributed
def test_under_torchrun_the_toy_units_split_over_two_gloo_ranks(texts, tmp_path):
    path, words = texts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "HEADLAB_PROGRESS": "plain"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={port}", __file__, "toy-words", "--texts", str(path), "--out", str(tmp_path / "c.json")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    figures = json.loads((tmp_path / "c.json").read_text())
    assert figures["words"] == words and figures["ranks"] == [0, 1, 0, 1, 0]  # every 2nd unit, from the rank


def _python(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


PROBE = """
import json, sys
from headlab.cli.main import main
code = 0
try:
    main({argv!r})
except SystemExit as e:
    code = e.code
print()
print(json.dumps({{"code": code, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}}))
"""


def test_help_imports_neither_torch_nor_transformers():
    got = _python(PROBE.format(argv=["--help"]))
    assert got == {"code": 0, "torch": False, "transformers": False}


@pytest.mark.parametrize("argv", [["memory", "--seq-len", "1000000000000", "--causal"],
                                  ["memory", "--seq-len", "4096", "--heads", "32", "--layers", "32", "--json"],
                                  ["flow", "--help"], ["heads", "importance", "--help"]])
def test_memory_and_command_help_import_no_transformers(argv):
    got = _python(PROBE.format(argv=argv))
    assert got["code"] in (0, None) and not got["transformers"], got


@pytest.mark.parametrize("argv", [["flow", "the cat", "--top", "0"], ["generate", "hi", "--top-k", "0"],
                                  ["train-gates", "--out", "g.json", "--steps", "0"], ["atlas", "--draws", "0"],
                                  ["heads", "ablate", "--boot", "1"], ["probe", "--treebank", "missing.conllu"],
                                  ["circuit", "--pairs", "0"], ["analyze", ""], ["patch", "--clean", "a"]])
def test_a_refusal_that_needs_no_model_imports_no_transformers(argv):
    got = _python(PROBE.format(argv=argv))
    assert got["code"] == 2 and not got["transformers"], got


def test_the_table_read_from_the_sources_is_the_registry():
    """Every shipped instrument, read from its source without importing it, is the registered class: its name,
    command words and help."""
    import inspect

    from headlab.cli.table import HOMES, shipped
    from headlab.interpret.study import base
    from headlab.interpret.study.base import registered

    assert HOMES == base.HOMES  # the table's list (read without torch) is the one the runner's lookup imports
    for home in HOMES:
        __import__(home)
    table = {e.name: e for e in shipped()}
    live = {i.name: i for i in registered() if i.name != Toy.name}
    assert set(table) == set(live) and len(table) >= 13
    for name, inst in live.items():
        assert table[name].command == tuple((inst.command or inst.name).split()), name
        assert table[name].help == inspect.cleandoc(inst.summary or inst.__doc__ or ""), name


if __name__ == "__main__":  # the torchrun test: this file's toy, as the command `headlab toy-words ...`
    from headlab.cli.main import main as headlab

    register(Toy)
    headlab(sys.argv[1:])


def test_subpackages_are_attributes_of_the_lazy_package():
    """``import headlab; headlab.models.adapt(...)`` works in a fresh process (the docs write it so), and an unknown
    name is still an AttributeError."""
    code = (
        "import headlab\n"
        "assert callable(headlab.models.adapt) and headlab.distributed.placement.Placement\n"
        "try:\n    headlab.no_such_thing\nexcept AttributeError as e:\n    print('refused', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused module 'headlab' has no attribute 'no_such_thing'" in done.stdout
