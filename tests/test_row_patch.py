"""``headlab patch`` is a row: the ``patch`` instrument's options are the command's (the flags, short flags and
defaults it has always had), a bad option or a degenerate pair is refused before any model loads, the exact
sweep split into one unit per site kind gives the numbers of one :func:`headlab.patch` call over every kind,
and Ctrl-C keeps the finished sweeps (an interrupted sweep is not one of them)."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
import transformers

import headlab
from conftest import command_params, run_cli, save_word_level
from headlab.interpret.instruments import get, runner
from headlab.interpret.patching import attribution_patch, patch
from headlab.interpret.patching.prompts import prompt_pair

WORDS = ["<pad>", "<unk>", "When", "Mary", "and", "John", "Anne", "Paul", "went", "to", "the", "store", ",", "gave",
         "a", "drink"]
CLEAN = "When Mary and John went to the store , John gave a drink to"
CORRUPT = "When Anne and Paul went to the store , Paul gave a drink to"
PAIR = {"clean": CLEAN, "corrupted": CORRUPT, "answer": " Mary", "wrong": " John"}

# the command's options as they were before it became a row: (python name, flags, default)
OPTIONS = [("clean", {"--clean"}, None), ("corrupted", {"--corrupted"}, None), ("answer", {"--answer"}, None),
           ("wrong", {"--wrong"}, None), ("model", {"--model", "-m"}, "smollm2"), ("sites", {"--sites"}, "z"),
           ("positions", {"--positions"}, None), ("method", {"--method"}, "exact"), ("top", {"--top"}, 10),
           ("out", {"--out", "-o"}, None), ("force", {"--force"}, False), ("as_json", {"--json"}, False)]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(WORDS), n_embd=32, n_layer=2, n_head=4, n_positions=32, attn_implementation="eager")).eval()
    return save_word_level(tmp_path_factory.mktemp("tiny-gpt2"), model, WORDS)


def _library(folder):
    loaded = headlab.load(str(folder))
    a, b, metric = prompt_pair(loaded, CLEAN, CORRUPT, " Mary", " John")
    return loaded, a, b, metric


def test_the_command_is_the_instruments_row():
    inst = get("patch")
    assert type(inst).__name__ == "Patch" and inst.result_kind == "patch"
    params = command_params("patch")
    flagged = [o.name for o in inst.options if not o.python]  # headlab.patch's own (inputs, metric, ...) have no flag
    assert set(params) == set(flagged) | {"tensor_parallel", "tensor_size", "resume"}  # the sweeps
    assert flagged == [name for name, _, _ in OPTIONS]  # are units: --resume (issue 39)
    for name, flags, default in OPTIONS:
        assert set(params[name].opts) == flags and params[name].default == default, name
    assert all(params[n].required for n in ("clean", "corrupted", "answer", "wrong"))


@pytest.mark.parametrize("options,match", [
    ({"method": "fast"}, r"--method 'fast': choose one of exact, attribution, both"),
    ({"sites": "z,bogus"}, r"--sites 'z,bogus': choose from the kinds"),
    ({"positions": "x"}, r"--positions takes 'each'"),
    ({"top": 0}, r"--top must be at least 1, got 0"),
    ({"out": "r.txt"}, r"give a file ending in .json"),
    ({"answer": " y", "wrong": " y"}, r"--answer and --wrong are both ' y'"),
    ({"corrupted": CLEAN}, r"--clean and --corrupted are the same text"),
    ({"wrong": "  "}, r"--wrong is empty"),
])
def test_bad_options_and_degenerate_pairs_are_refused_before_the_load(options, match, no_load):
    with pytest.raises(headlab.errors.HeadlabError, match=match):
        runner.run("patch", {**PAIR, "model": "minilm", **options})


def test_the_sweeps_are_units_and_together_equal_one_library_call(tiny_folder, tmp_path, capsys):
    """Exact patching split per kind (z, v) gives one call's grids over both kinds; attribution is its own unit;
    the agreement is recomputed from the two grids of the document."""
    from scipy.stats import spearmanr

    inst = get("patch")
    code, out, err = run_cli(["patch", "--model", tiny_folder, "--clean", CLEAN, "--corrupted", CORRUPT, "--answer",
                              " Mary", "--wrong", " John", "--method", "both", "--sites", "z,v", "--json", "--out",
                              tmp_path / "r.json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    loaded, a, b, metric = _library(tiny_folder)
    want = patch(loaded, a, b, metric, sites=["z", "v"])
    for kind in ("z", "v"):
        got = torch.tensor(doc["exact"]["raw"][kind], dtype=torch.float32)
        assert torch.allclose(got, want.raw[kind], atol=1e-5), kind
        rho = spearmanr(torch.tensor(doc["exact"]["effects"][kind]).flatten(),
                        torch.tensor(doc["attribution"]["effects"][kind]).flatten()).statistic
        assert doc["agreement"][kind]["spearman"] == pytest.approx(float(rho), abs=1e-6)
    assert doc["exact"]["clean"] == pytest.approx(want.clean, abs=1e-5)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["headlab"]["kind"] == "patch" and saved["headlab"]["settings"]["sites"] == ["z", "v"]
    assert "units" not in saved  # a finished run writes the result, not its units
    from headlab.interpret.study.base import Context

    ctx = Context(inst, runner.check_options(inst, {**PAIR, "method": "both", "sites": "z,v"}))
    inst.check(ctx)
    assert [u.key for u in inst.units(ctx)] == ["exact z", "exact v", "attribution"]


def test_ctrl_c_keeps_the_finished_sweeps(tiny_folder, tmp_path, capsys, monkeypatch):
    """Ctrl-C in the attribution unit keeps both exact sweeps (in the file, equal to the library's); Ctrl-C half-way
    through the second sweep (which the library catches, keeping a partial grid) keeps only the first."""
    import headlab.interpret.patching as patching
    from headlab.interpret.patching import runs

    args = ["patch", "--model", tiny_folder, "--clean", CLEAN, "--corrupted", CORRUPT, "--answer", " Mary", "--wrong",
            " John", "--sites", "z,v"]

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(patching, "attribution_patch", stop)
    code, _, err = run_cli([*args, "--method", "both", "--out", tmp_path / "a.json"], capsys)
    assert code == 130 and f"interrupted: kept 2 of 3 units in {tmp_path / 'a.json'}" in err, err
    kept = json.loads((tmp_path / "a.json").read_text())
    assert kept["interrupted"] == {"kept": 2, "of": 3} and set(kept["units"]) == {"exact z", "exact v"}
    loaded, a, b, metric = _library(tiny_folder)
    for kind in ("z", "v"):
        want = patch(loaded, a, b, metric, sites=kind).raw[kind]
        got = torch.tensor(kept["units"][f"exact {kind}"]["raw"][kind], dtype=torch.float32)
        assert torch.allclose(got, want, atol=1e-5)
    monkeypatch.setattr(patching, "attribution_patch", attribution_patch)
    line = [ln for ln in err.splitlines() if ln.startswith("interrupted")][0]
    again = shlex.split(line.split("to finish the rest: ", 1)[1])  # the printed command, pasted back
    assert again[:2] == ["headlab", "patch"] and again[-1] == "--resume"
    sweeps = []
    monkeypatch.setattr(patching, "patch", lambda *a, **k: sweeps.append(k) or patch(*a, **k))
    code, _, err = run_cli(again[1:], capsys)
    assert code == 0 and sweeps == [], err  # only attribution ran: both sweeps came from the file
    done = json.loads((tmp_path / "a.json").read_text())
    fresh = tmp_path / "fresh.json"
    assert run_cli([*args, "--method", "both", "--out", fresh], capsys)[0] == 0
    want = json.loads(fresh.read_text())
    for method in ("exact", "attribution"):
        assert done[method]["effects"] == want[method]["effects"], method  # equal to an uninterrupted run
    for kind, row in want["agreement"].items():  # the kept grids are to 6 decimals
        assert {k: v for k, v in done["agreement"][kind].items() if not isinstance(v, float)} == \
            {k: v for k, v in row.items() if not isinstance(v, float)}, kind
        far = {k: (done["agreement"][kind][k], v) for k, v in row.items()
               if isinstance(v, float) and k != "time_ratio"  # a measured time, not a number of the grids
               and done["agreement"][kind][k] != pytest.approx(v, rel=1e-6, abs=1e-9)}
        assert not far, (kind, far)

    real, forwards = runs.run_metric, []

    def third_patched_forward_of_v(pair, metric, inputs, copies, edits=None, **kw):  # v's sweep: a forward per layer
        if edits and any(name.endswith(".v") for name in edits):
            forwards.append(1)
            if len(forwards) == 2:
                raise KeyboardInterrupt
        return real(pair, metric, inputs, copies, edits=edits, **kw)

    monkeypatch.setattr(runs, "run_metric", third_patched_forward_of_v)
    monkeypatch.setattr(runs, "copies_per_forward", lambda n, max_rows: 4)  # one layer's 4 heads per forward
    code, _, err = run_cli([*args, "--out", tmp_path / "b.json"], capsys)
    assert code == 130 and "interrupted: kept 1 of 2 units" in err, err
    kept = json.loads((tmp_path / "b.json").read_text())
    assert set(kept["units"]) == {"exact z"}  # v's partial grid is not a finished unit
