"""``headlab explain`` is a row: the ``explain`` instrument's options are the command's (the flags and defaults it
has always had), a bad option, a study option without ``--dataset`` or a dataset without its label column is
refused before any model loads, ``--tensor-parallel`` outside torchrun is refused before it, what the row prints is what
:func:`headlab.explain` computes on the same model, and Ctrl-C in the corpus study keeps every finished row
(the runner's units, in ``instances.json``), from which the printed ``--resume`` command explains only the rest
and ends with the result an uninterrupted run writes."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import headlab
from conftest import command_params, run_cli
from headlab.errors import HeadlabError, InputError
from headlab.interpret.instruments import get, runner
from headlab.interpret.saliency import DEFAULT_METHODS

TEXT = "a gripping , funny and moving film"
ROWS = ["a gripping film", "a dull , boring film", "funny", "it moved me"]

# the command's options as they were before it became a row: (python name, flags, default)
OPTIONS = [("text", set(), None), ("model", {"--model", "-m"}, None),
           ("methods", {"--methods"}, ",".join(DEFAULT_METHODS)), ("target", {"--target"}, None),
           ("ig_steps", {"--ig-steps"}, 50), ("backend", {"--backend"}, "auto"), ("loo", {"--loo"}, "delete"),
           ("compare_to", {"--compare-to"}, None), ("truncate", {"--truncate"}, False), ("dataset", {"--dataset"}, None),
           ("limit", {"--limit"}, None), ("no_counterfactual", {"--no-counterfactual"}, False),
           ("max_minutes", {"--max-minutes"}, None), ("out", {"--out", "-o"}, None), ("force", {"--force"}, False),
           ("as_json", {"--json"}, False)]


@pytest.fixture(scope="module")
def clf_dir(tmp_path_factory):
    from headlab.models.named_models import minilm_dir

    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    torch.manual_seed(0)
    m = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, attn_implementation="eager", num_labels=2)).eval()
    d = tmp_path_factory.mktemp("clf")
    m.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "d.tsv"
    p.write_text("sentence\tlabel\n" + "".join(f"{t}\t{i % 2}\n" for i, t in enumerate(ROWS)))
    return p


def test_the_command_is_the_instruments_row():
    inst = get("explain")
    assert type(inst).__name__ == "Explain" and inst.result_kind == "explain"
    params = command_params("explain")
    cli = [o.name for o in inst.options if not o.python]  # headlab.explain's and study's own settings have no flag
    assert set(params) == set(cli) | {"tensor_parallel", "tensor_size", "resume"}
    assert cli == [name for name, _, _ in OPTIONS]
    for name, flags, default in OPTIONS:
        assert set(params[name].opts) - {name} == flags and params[name].default == default, name
    assert params["model"].required and not params["text"].required


@pytest.mark.parametrize("options,match", [
    ({"limit": 0}, r"--limit: it acts only with --dataset"),
    ({"max_minutes": 0.0, "no_counterfactual": True}, r"--max-minutes, --no-counterfactual: they act only with"),
    ({"text": None}, r"no text: give TEXT"),
    ({"target": -1}, r"--target must be at least 0 \(a class or token id\), got -1"),
    ({"methods": "gradient,rolout"}, r"did you mean 'rollout'"),
    ({"ig_steps": 0}, r"ig_steps"),
    ({"loo": "bogus"}, r"unknown loo mode 'bogus'"),
    ({"compare_to": " "}, r"--compare-to is empty"),
    ({"dataset": "{data}"}, r"give either TEXT or --dataset, not both"),
    ({"text": None, "dataset": "{data}"}, r"--dataset needs --out DIR"),
    ({"text": None, "dataset": "{nolabel}", "out": "{tmp}/o"}, r"no column label"),
    ({"text": None, "dataset": "{data}", "out": "{tmp}/o", "limit": 0}, r"--limit must be at least 1 row, got 0"),
    ({"text": None, "dataset": "{data}", "out": "{tmp}/o", "max_minutes": float("nan")},
     r"--max-minutes must be a number > 0, got nan"),
])
def test_bad_options_are_refused_before_the_load(options, match, tmp_path, data, no_load):
    (tmp_path / "n.tsv").write_text("text\tscore\nx\t1\n")
    fill = {"data": data, "nolabel": tmp_path / "n.tsv", "tmp": tmp_path}
    options = {k: (v.format(**fill) if isinstance(v, str) else v) for k, v in options.items()}
    with pytest.raises(HeadlabError, match=match):
        runner.run("explain", {"text": TEXT, "model": "minilm", **options})
    assert not (tmp_path / "o").exists()


def test_tensor_parallel_outside_torchrun_is_refused_before_the_load(no_load, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(InputError, match=r"--tensor-parallel shards the model over several processes: launch with "
                                         r"torchrun"):
        runner.run("explain", {"text": None, "dataset": "x.tsv", "out": "o", "model": "minilm"}, tensor_parallel=True)


def test_the_row_prints_the_librarys_explanation(clf_dir, tmp_path, capsys):
    code, out, err = run_cli(["explain", TEXT, "--model", clf_dir, "--methods", "gradient,leave_one_out", "--json",
                              "--out", tmp_path / "ex"], capsys)
    assert code == 0, err
    j = json.loads(out)
    want = headlab.explain(headlab.load(str(clf_dir)), TEXT, methods="gradient,leave_one_out")
    for m in ("gradient", "leave_one_out"):
        assert j["scores"][m] == pytest.approx(want.scores[m], abs=1e-6)
    assert j["target"] == want.target and j["files"]["html"] == str(tmp_path / "ex" / "explanation.html")
    saved = json.loads((tmp_path / "ex" / "explanation.json").read_text())
    assert saved["scores"]["gradient"] == pytest.approx(want.scores["gradient"], abs=1e-6)


def test_ctrl_c_in_the_study_keeps_the_finished_rows_and_a_rerun_does_only_the_rest(clf_dir, data, tmp_path, capsys,
                                                                                       monkeypatch):
    from headlab.interpret.saliency import corpus_study

    real, seen = corpus_study.instance, []

    def third_row_stops(loaded, row, opts):
        seen.append(row.text)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return real(loaded, row, opts)

    monkeypatch.setattr(corpus_study, "instance", third_row_stops)
    out = tmp_path / "study"
    args = ["explain", "--dataset", data, "--model", clf_dir, "--methods", "attention,gradient", "--no-counterfactual",
            "--out", out]
    code, _, err = run_cli(args, capsys)
    assert code == 130 and f"interrupted: kept 2 of 4 units in {out / 'instances.json'}" in err, err
    kept = json.loads((out / "instances.json").read_text())
    assert kept["interrupted"] == {"kept": 2, "of": 4}
    assert [u["line"] for u in kept["units"].values()] == [2, 3]
    assert not (out / "study.json").exists()
    again = err.split("to finish the rest: ")[1].split()  # the printed command line, pasted back
    assert again[0] == "headlab" and again[-1] == "--resume"
    seen.clear()
    code, stdout, err = run_cli(again[1:], capsys)
    assert code == 0, err
    assert seen == ROWS[2:]  # only the rows not yet explained
    doc = json.loads((out / "study.json").read_text())
    assert doc["instances"] == 4 and doc["n"] == 4 and "4 instances" in stdout
    monkeypatch.setattr(corpus_study, "instance", real)  # the same study, never interrupted: the same result
    code, _, err = run_cli([*args[:-1], tmp_path / "whole"], capsys)
    assert code == 0, err
    whole = json.loads((tmp_path / "whole" / "study.json").read_text())
    for k in ("n", "accuracy", "kendall", "faithfulness", "options", "skipped"):
        assert doc[k] == whole[k], k
    resumed, once = (json.loads((d / "instances.json").read_text())["units"] for d in (out, tmp_path / "whole"))
    assert resumed == once and "interrupted" not in json.loads((out / "instances.json").read_text())


def test_a_study_folder_is_resumed_or_replaced_only_when_asked(clf_dir, data, tmp_path, capsys):
    """A finished study's folder: a rerun is refused (nothing computed), --resume keeps every row and explains
    none, --limit may grow under --resume (the new rows only), and --force starts again."""
    from headlab.interpret.saliency import corpus_study

    out = tmp_path / "study"
    args = ["explain", "--dataset", data, "--model", clf_dir, "--methods", "attention,gradient", "--no-counterfactual",
            "--out", out]
    assert run_cli([*args, "--limit", "2"], capsys)[0] == 0
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "exists and is not empty" in err, err
    seen = []
    real = corpus_study.instance

    def counted(loaded, row, opts):
        seen.append(row.line)
        return real(loaded, row, opts)

    corpus_study.instance, saved = counted, corpus_study.instance
    try:
        code, stdout, err = run_cli([*args, "--resume"], capsys)
        assert code == 0 and seen == [4, 5] and "4 instances" in stdout, err
        seen.clear()
        assert run_cli([*args, "--resume"], capsys)[0] == 0 and seen == []
        code, _, err = run_cli([*args, "--resume", "--methods", "attention"], capsys)
        assert code == 2 and "other settings (methods)" in err, err
        assert run_cli([*args, "--force"], capsys)[0] == 0 and seen == [2, 3, 4, 5]
    finally:
        corpus_study.instance = saved
