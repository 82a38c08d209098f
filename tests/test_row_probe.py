"""``headlab probe`` as the runner's units: the batches of sentences, then the gradient test's batches; the same
numbers as ``headlab.probe``, Ctrl-C keeps the finished batches in ``OUT/relations.json`` and ``--resume`` does only
the rest, and under torchrun the runner splits the batches over the ranks and rank 0 writes one process's result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli
from test_probing import CONLLU, tiny_llama

import headlab
from headlab.interpret.instruments import runner
from headlab.interpret.probing import ProbeResult, head_scores
from headlab.interpret.probing.head_scores import ProbeRun

FIGURES = ("accuracy", "count", "visible", "baseline_accuracy", "baseline_offset", "head_map")


@pytest.fixture
def one_per_batch(monkeypatch):
    monkeypatch.setattr(head_scores, "MAX_BATCH", 1)  # every sentence its own batch: several units


@pytest.fixture
def setup(tmp_path):
    """A tiny Llama saved to a folder (it has an LM loss: the gradient test runs) and a 6-sentence treebank."""
    loaded = tiny_llama()
    folder = tmp_path / "tiny-llama"
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    tb = tmp_path / "tb.conllu"
    tb.write_text(CONLLU * 3, encoding="utf-8")
    return folder, tb


def _same(got: ProbeResult, want: ProbeResult) -> None:
    for name in FIGURES:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert got.per_head.keys() == want.per_head.keys()
    for name, v in want.per_head.items():
        np.testing.assert_array_equal(got.per_head[name], v, err_msg=name)
    assert (got.sentences, got.tokens, got.grad_note, got.notes, got.skipped) == \
        (want.sentences, want.tokens, want.grad_note, want.notes, want.skipped)


def test_the_units_are_the_batches_then_the_gradient_test_and_add_up_to_the_api(setup, one_per_batch, tmp_path):
    folder, tb = setup
    loaded = headlab.load(str(folder))
    run = ProbeRun(loaded, tb)
    assert run.units() == [f"batch {i}" for i in range(1, 7)] + [f"gradients {i}" for i in range(1, 7)]
    value = run.unit("batch 1")
    assert json.loads(json.dumps(value)) == value  # JSON as it is
    outcome = runner.run("probe", {"treebank": tb, "model": str(folder), "out": tmp_path / "o"})
    assert outcome.total == 12 and outcome.path == tmp_path / "o" / "relations.json"
    want = headlab.probe(loaded, tb)
    _same(outcome.result.native, want)
    _same(ProbeResult.load(outcome.path), ProbeResult.from_json(json.loads(json.dumps(want.to_json()))))
    assert "units" not in json.loads(outcome.path.read_text())  # the finished file is the result alone


def test_ctrl_c_keeps_the_finished_batches_and_resume_does_only_the_rest(setup, one_per_batch, tmp_path, capsys,
                                                                         monkeypatch):
    folder, tb = setup
    real, seen = ProbeRun.unit, []

    def third_stops(self, key):
        seen.append(key)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return real(self, key)

    monkeypatch.setattr(ProbeRun, "unit", third_stops)
    out = tmp_path / "o"
    args = ["probe", "--treebank", tb, "--model", folder, "--out", out]
    code, _, err = run_cli(args, capsys)
    assert code == 130 and f"interrupted: kept 2 of 12 units in {out / 'relations.json'}" in err, err
    kept = json.loads((out / "relations.json").read_text())
    assert kept["interrupted"] == {"kept": 2, "of": 12} and list(kept["units"]) == ["batch 1", "batch 2"]
    assert not (out / "probe.html").exists()
    again = err.split("to finish the rest: ")[1].split()  # the printed command line, pasted back
    assert again[0] == "headlab" and again[-1] == "--resume"
    code, _, err = run_cli(args, capsys)  # the folder holds the kept units: not replaced without being asked
    assert code == 2 and "exists and is not empty" in err, err
    seen.clear()
    monkeypatch.setattr(ProbeRun, "unit", lambda self, key: (seen.append(key), real(self, key))[1])
    code, stdout, err = run_cli(again[1:], capsys)
    assert code == 0, err
    assert seen == [f"batch {i}" for i in range(3, 7)] + [f"gradients {i}" for i in range(1, 7)]  # only the rest
    assert (out / "probe.html").exists()
    resumed = ProbeResult.load(out / "relations.json")
    code, _, err = run_cli([*args[:-1], tmp_path / "whole"], capsys)  # never interrupted: the same result
    assert code == 0, err
    _same(resumed, ProbeResult.load(tmp_path / "whole" / "relations.json"))
    code, _, err = run_cli([*args, "--resume"], capsys)  # a finished folder keeps no units: said, nothing replaced
    assert code == 2 and "keeps no units to resume from" in err, err


def test_ctrl_c_before_any_batch_writes_nothing(setup, tmp_path, capsys, monkeypatch):
    folder, tb = setup

    def stops(self, key):
        raise KeyboardInterrupt

    monkeypatch.setattr(ProbeRun, "unit", stops)
    code, _, err = run_cli(["probe", "--treebank", tb, "--model", folder, "--out", tmp_path / "o"], capsys)
    assert code == 130 and "nothing was written (no unit had finished)" in err, err
    assert not (tmp_path / "o" / "relations.json").exists()


def test_resume_refuses_units_kept_for_another_treebank(setup, one_per_batch, tmp_path, capsys, monkeypatch):
    folder, tb = setup
    real = ProbeRun.unit

    def second_stops(self, key):
        if key == "batch 2":
            raise KeyboardInterrupt
        return real(self, key)

    monkeypatch.setattr(ProbeRun, "unit", second_stops)
    args = ["probe", "--treebank", tb, "--model", folder, "--out", tmp_path / "o"]
    assert run_cli(args, capsys)[0] == 130
    monkeypatch.setattr(ProbeRun, "unit", real)
    tb.write_text(CONLLU.replace("\tShe\t", "\tHe\t") * 3, encoding="utf-8")  # the same path, other sentences
    code, _, err = run_cli([*args, "--resume"], capsys)
    assert code == 2 and "the kept units batch 1 were computed for another treebank" in err, err


RANK_SCRIPT = '''
import json, os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from headlab.interpret.instruments import runner
from headlab.interpret.probing import head_scores
head_scores.MAX_BATCH = 1
seen = []
real = head_scores.ProbeRun.unit
head_scores.ProbeRun.unit = lambda self, key: (seen.append(key), real(self, key))[1]
out = runner.run("probe", {{"treebank": Path({tb!r}), "model": {model!r}, "out": Path({out!r})}})
Path({log!r} + os.environ["RANK"]).write_text(json.dumps({{"units": seen, "main": out.main}}))
'''


@pytest.mark.distributed
def test_under_torchrun_the_runner_splits_the_batches_and_rank_0_writes_one_process_s_result(setup, one_per_batch,
                                                                                             tmp_path):
    import os
    import socket
    import subprocess
    import sys

    folder, tb = setup
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(tests=str(Path(__file__).parent), tb=str(tb), model=str(folder),
                                         out=str(tmp_path / "two"), log=str(tmp_path / "rank")))
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "HEADLAB_PROGRESS": "plain"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    got = [json.loads((tmp_path / f"rank{r}").read_text()) if (tmp_path / f"rank{r}").exists() else logs[r]
           for r in range(2)]
    assert all(isinstance(g, dict) for g in got), got
    keys = ProbeRun(headlab.load(str(folder)), tb).units()
    assert got[0]["units"] == keys[0::2] and got[1]["units"] == keys[1::2]  # every 2nd unit, from the rank
    assert got[0]["main"] and not got[1]["main"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (OMP_NUM_THREADS=1): a product's sums split alike on any CPU
    try:
        one = runner.run("probe", {"treebank": tb, "model": str(folder), "out": tmp_path / "one"}).result.native
    finally:
        torch.set_num_threads(threads)
    two = ProbeResult.load(tmp_path / "two" / "relations.json")
    one = ProbeResult.from_json(json.loads(json.dumps(one.to_json())))  # the rounding the file went through
    for name in ("accuracy", "count", "visible", "baseline_accuracy", "baseline_offset"):
        np.testing.assert_array_equal(getattr(two, name), getattr(one, name), err_msg=name)
    for name, v in one.per_head.items():  # one thread against the test's: float sums alike to rounding
        np.testing.assert_allclose(two.per_head[name], v, rtol=1e-6, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(np.abs(two.head_map), np.abs(one.head_map), atol=1e-6)
    assert (two.sentences, two.tokens, two.grad_note) == (one.sentences, one.tokens, one.grad_note)
