"""``headlab circuit --resume``: a run interrupted after its first unit (the edge scores) keeps that unit in
``OUT/circuit.partial.json`` beside ``scores.json``, prints the command that resumes it, and that command, pasted
back, runs only the circuit and the curve and writes the files an uninterrupted run writes (the scores are read back
exactly, so every figure is equal, not close); with other settings, the kept units are refused."""

from __future__ import annotations

import shlex
from importlib import import_module

import pytest
import torch

from conftest import run_cli
from headlab.interpret.circuits.circuit import Circuit
from headlab.interpret.circuits.faithfulness_result import Faithfulness
from headlab.interpret.circuits.result import EdgeScores
from headlab.interpret.instruments.circuit import FILES
from headlab.models.transformer import Transformer, TransformerConfig

RUN = ["--task", "induction", "--pairs", "4", "--steps", "2", "--edges", "20%", "--random", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("circuit-resume") / "tiny"
    Transformer(TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True)) \
        .eval().save(path)
    return path


def test_an_interrupted_circuit_resumes_from_the_printed_line_to_the_uninterrupted_files(tiny, tmp_path, capsys,
                                                                                          monkeypatch):
    eap = import_module("headlab.interpret.circuits.eap")  # the modules (the package exports functions of these names)
    discovery = import_module("headlab.interpret.circuits.discovery")
    straight, out = tmp_path / "straight", tmp_path / "o"
    code, _, err = run_cli(["circuit", "--model", tiny, *RUN, "--out", straight], capsys)
    assert code == 0, err

    real_discover, scored = discovery.discover, []

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(discovery, "discover", stop)  # Ctrl-C in the second unit: the scores are finished
    code, so, err = run_cli(["circuit", "--model", tiny, *RUN, "--out", out], capsys)
    assert code == 130 and so == "", err
    line = next(ln for ln in err.splitlines() if ln.startswith("interrupted:"))
    assert line.startswith(f"interrupted: kept 1 of 3 units in {out / 'scores.json'}; run again with --resume")
    assert sorted(p.name for p in out.iterdir()) == ["circuit.partial.json", "scores.json"]
    printed = line.partition("finish the rest: headlab ")[2]
    assert printed, line
    again = shlex.split(printed)
    assert again[-1] == "--resume" and again[:-1] == ["circuit", "--model", str(tiny), *RUN, "--out", str(out)]

    code, _, err = run_cli(again[:-1], capsys)  # without --resume the kept folder is not written into
    assert code == 2 and "--force" in err, err
    other = ["circuit", "--model", tiny, *RUN[:-1], "2", "--out", out, "--resume"]  # --random 2: another run
    code, _, err = run_cli(other, capsys)
    assert code == 2 and "other settings (random)" in err, err
    monkeypatch.setattr(discovery, "discover", lambda *a, **k: (scored.append("circuit"), real_discover(*a, **k))[1])
    real_scores = eap.edge_scores
    monkeypatch.setattr(eap, "edge_scores", lambda *a, **k: (scored.append("scores"), real_scores(*a, **k))[1])
    code, so, err = run_cli(again, capsys)
    assert code == 0, err
    assert scored == ["circuit"]  # the scores were read back, not computed again
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)  # the partial file is gone
    a, b = EdgeScores.load(out / "scores.json"), EdgeScores.load(straight / "scores.json")
    assert a.edges == b.edges and torch.equal(a.values, b.values) and (a.clean, a.corrupted) == (b.clean, b.corrupted)
    ca, cb = Circuit.load(out / "circuit.json"), Circuit.load(straight / "circuit.json")
    assert ca.edges == cb.edges and ca.scores == cb.scores
    assert (ca.circuit_metric, ca.empty, ca.faithfulness) == (cb.circuit_metric, cb.empty, cb.faithfulness)
    fa, fb = Faithfulness.load(out / "faithfulness.json"), Faithfulness.load(straight / "faithfulness.json")
    assert (fa.sizes, fa.kept, fa.values, fa.f, fa.cpr, fa.cmd) == (fb.sizes, fb.kept, fb.values, fb.f, fb.cpr, fb.cmd)
    page = (out / "circuit.html").read_text(encoding="utf-8")
    assert page.count('<line class="edge"') == len(ca.edges) and '<svg class="faithfulness"' in page
    assert "wrote: " in so and str(out / "faithfulness.json") in so

