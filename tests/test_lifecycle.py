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
