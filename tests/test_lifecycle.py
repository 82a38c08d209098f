"""The runner owns the lifecycle (issue 39): a model folder without a tokenizer is refused before the load for an
instrument that reads text; a refusal after the checks leaves no ``--out`` folder behind; an output another run is
writing is refused (the lock beside it); Ctrl-C before the units (while loading) exits 130 with one line."""

from __future__ import annotations

import os

import pytest

from conftest import run_cli


@pytest.fixture
def no_tokenizer(tmp_path):
    import transformers

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32)
    folder = tmp_path / "notok"
    transformers.BertModel(cfg).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("argv", [["flow", "a b"], ["analyze", "a b", "--out", "{tmp}/rep"],
                                  ["patch", "--clean", "a b", "--corrupted", "a c", "--answer", " x", "--wrong", " y"],
                                  ["generate", "a b"]])
def test_a_model_without_a_tokenizer_is_refused_before_the_load(argv, no_tokenizer, tmp_path, no_load, capsys):
    args = [a.format(tmp=tmp_path) for a in argv] + ["--model", str(no_tokenizer)]
    code, out, err = run_cli(args, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "has no tokenizer" in lines[0] and "reads text" in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notok"]  # nothing made


def test_a_refused_load_leaves_no_report_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HEADLAB_MEMORY_LIMIT", "1MiB")  # the weights do not fit: refused at the load
    code, _, err = run_cli(["analyze", "the cat sat", "--out", str(tmp_path / "rep")], capsys)
    assert code == 2 and "needs about" in err, err
    assert not (tmp_path / "rep").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, guarded", [(["analyze", "a b", "--out", "{tmp}/rep"], "rep"),
                                           (["generate", "a b", "--out", "{tmp}/g.json"], "g.json")])
def test_an_output_another_run_is_writing_is_refused(argv, guarded, tmp_path, no_load, capsys):
    from headlab.locks import lock_path

    lock = lock_path(tmp_path / guarded)
    lock.write_text(str(os.getppid()))  # a live process (this test's parent) holds it
    code, _, err = run_cli([a.format(tmp=tmp_path) for a in argv], capsys)
    assert code == 2 and "is being written by another headlab run" in err and str(os.getppid()) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [lock.name]  # nothing else made, the lock not taken


def test_ctrl_c_while_loading_exits_130_with_one_line(monkeypatch, capsys):
    import headlab.models

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(headlab.models, "load", interrupted)
    code, out, err = run_cli(["flow", "the cat sat"], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("loading")]
    assert code == 130 and lines == ["interrupted before any work was done; nothing was written"], err


WORDS = ["<pad>", "<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    import torch
    import transformers

    from conftest import save_word_level

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(WORDS), n_embd=32, n_layer=2, n_head=4, n_positions=32, attn_implementation="eager")).eval()
    return save_word_level(tmp_path_factory.mktemp("tiny-gpt2"), model, WORDS)


@pytest.mark.parametrize("name, options", [
    ("flow", {"text": "the cat sat on the mat"}),
    ("heads-importance", {"data": "{tmp}/ex.txt", "loss": "lm", "batch_size": 1}),
    ("patch", {"clean": "the cat sat", "corrupted": "the dog sat", "answer": " on", "wrong": " a"}),
])
def test_from_python_the_runner_takes_a_model_loaded_already(name, options, tiny_gpt2, tmp_path, monkeypatch):
    """``runner.run(name, {..., "model": loaded})``: the load hook hands the loaded model over (no second load), the
    settings name it, and the result equals the run that loads the same folder by its path."""
    import headlab
    import headlab.models
    from headlab.interpret.instruments import runner

    (tmp_path / "ex.txt").write_text("the cat sat on the mat\na dog ran\n")
    opts = {k: (v.format(tmp=tmp_path) if isinstance(v, str) and "{tmp}" in v else v) for k, v in options.items()}
    by_path = runner.run(name, {**opts, "model": str(tiny_gpt2)}).result
    loaded = headlab.load(str(tiny_gpt2))
    monkeypatch.setattr(headlab.models, "load", lambda *a, **k: pytest.fail("loaded a second time"))
    given = runner.run(name, {**opts, "model": loaded}).result
    assert given.settings.get("model", loaded.name) == loaded.name
    a, b = given.to_json(), by_path.to_json()
    for key in ("headlab",):
        a.pop(key), b.pop(key)
    drop = ("seconds", "time_ratio", "model")

    def same(x, y):
        if isinstance(x, dict):
            return set(x) == set(y) and all(k in drop or same(x[k], y[k]) for k in x)
        if isinstance(x, list):
            return len(x) == len(y) and all(same(i, j) for i, j in zip(x, y, strict=True))
        if isinstance(x, float) and isinstance(y, float):
            return x == pytest.approx(y, rel=1e-6, abs=1e-9, nan_ok=True)
        return x == y

    assert same(a, b)


class _Folder:
    """A toy instrument whose output is a folder of its own files (as circuit and heads prune): one file per unit."""

    @staticmethod
    def make(stop_at: list[int]):
        from headlab.interpret.study.base import Instrument, InstrumentResult, Option, Output, Unit

        class Folder(Instrument):
            name = "toy-folder"
            command = None
            resumable = True
            needs_model = False
            options = (Option("n", "--n", int, 4), Option("out", "--out", None, None, setting=False),
                       Option("scale", None, int, 1, python=True))
            output = Output("out", folder=True, file=None)

            def units(self, ctx):
                return [Unit(str(i), i) for i in range(ctx.options["n"])]

            def run_unit(self, ctx, unit, recording=None):
                if stop_at and unit.payload == stop_at[0]:
                    stop_at.clear()
                    raise KeyboardInterrupt
                return unit.payload * 10 * ctx.options["scale"]

            def write_kept(self, ctx, values, path):
                return [self._one(path, k, v) for k, v in values.items()]

            @staticmethod
            def _one(path, k, v):
                (path / f"u{k}.txt").write_text(str(v))
                return path / f"u{k}.txt"

            def finish(self, ctx, values):
                return InstrumentResult(self.name, figures={"values": [values[k] for k in sorted(values, key=int)]},
                                        native=sum(values.values()))

            def write(self, ctx, result, path):
                return [self._one(path, "all", result.figures["values"])]

        return Folder()


def test_a_folder_output_is_resumed_from_its_kept_units(tmp_path):
    """An instrument writing a folder of its own files keeps its finished units in NAME.partial.json in that folder
    on Ctrl-C, and --resume runs only the rest; the finished folder drops the partial file."""
    from headlab.interpret.study import runner

    stop = [2]
    inst = _Folder.make(stop)
    said: list[str] = []
    out = runner.run(inst, {"out": tmp_path / "f"}, say=said.append, command="headlab toy-folder --out f")
    assert out.interrupted and out.kept == 2 and out.total == 4
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["toy-folder.partial.json", "u0.txt", "u1.txt"]
    assert said == [f"interrupted: kept 2 of 4 units in {tmp_path / 'f' / 'u0.txt'}; run again with --resume to "
                    "finish the rest: headlab toy-folder --out f --resume"]
    ran: list[int] = []
    inst.run_unit = lambda ctx, unit, recording=None: ran.append(unit.payload) or unit.payload * 10  # type: ignore
    done = runner.run(inst, {"out": tmp_path / "f"}, resume=True)
    assert ran == [2, 3] and done.result.figures["values"] == [0, 10, 20, 30]
    assert not (tmp_path / "f" / "toy-folder.partial.json").exists() and (tmp_path / "f" / "uall.txt").is_file()
    from headlab.errors import InputError

    runner.run(_Folder.make([1]), {"out": tmp_path / "g", "n": 3}, say=lambda line: None)
    with pytest.raises(InputError, match="other settings"):  # a different run is not resumed from those units
        runner.run(inst, {"out": tmp_path / "g", "n": 5}, resume=True)


def test_a_library_call_goes_through_the_runner(tmp_path):
    """runner.call: the options by their Python names (messages too), Python-only options taken, the native
    result returned, Ctrl-C raised; the command line refuses a Python-only option."""
    import dataclasses

    from headlab.errors import ConfigError, InputError
    from headlab.interpret.study import runner
    from headlab.interpret.study.base import at_least

    inst = _Folder.make([])
    assert runner.call(inst, {"scale": 2}) == sum(i * 20 for i in range(4))
    inst.options = (dataclasses.replace(inst.options[0], check=at_least(1)), *inst.options[1:])
    with pytest.raises(ConfigError, match=r"^n must be at least 1, got 0"):
        runner.call(inst, {"n": 0})
    with pytest.raises(ConfigError, match=r"^--n must be at least 1, got 0"):  # the command's words
        runner.run(inst, {"n": 0})
    with pytest.raises(InputError, match="takes no option scale"):
        runner.run(inst, {"scale": 2})
    with pytest.raises(KeyboardInterrupt):
        runner.call(_Folder.make([1]), {})


def test_a_view_shows_an_instrument_and_a_plugin_may_render_itself(capsys):
    """headlab.cli.views: a registered view is used; else an instrument's own render; else the figures."""
    from rich.console import Console

    from headlab.cli import views
    from headlab.interpret.study.base import Context, InstrumentResult, Outcome

    inst = _Folder.make([])
    out = Outcome(InstrumentResult(inst.name, figures={"values": [1]}))
    ctx = Context(inst, {})
    console, err = Console(), Console(stderr=True)
    views.render(ctx, out, console, err)
    assert capsys.readouterr().out.strip() == "{'values': [1]}"
    inst.render = lambda ctx, outcome, console, err: console.print("own")  # type: ignore[attr-defined]
    views.render(ctx, out, console, err)
    assert capsys.readouterr().out.strip() == "own"
    views.view(inst.name)(lambda ctx, outcome, console, err: console.print("view"))
    try:
        views.render(ctx, out, console, err)
        assert capsys.readouterr().out.strip() == "view"
    finally:
        views._VIEWS.unregister(inst.name)
