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
