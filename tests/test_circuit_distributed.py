"""``headlab circuit`` under torchrun: the scoring splits the pairs across 2 gloo ranks (3 and 2 of 5 pairs, so the
weighting by pairs matters) and adds their scores; the circuit and the faithfulness curve then run alike on every
rank and rank 0 writes. Every file's figures equal one process's (the independent computation) to 1e-5."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from headlab.interpret.circuits.circuit import Circuit
from headlab.interpret.circuits.faithfulness_result import Faithfulness
from headlab.interpret.circuits.result import EdgeScores
from headlab.models.transformer import Transformer, TransformerConfig
from test_tensor_parallel import run_world

WORKER = Path(__file__).parent / "workers" / "circuit_worker.py"
sys.path.insert(0, str(WORKER.parent))
import circuit_worker  # noqa: E402  (the worker's arguments, shared)

pytestmark = pytest.mark.distributed


def test_two_ranks_write_one_process_s_files(tmp_path, capsys):
    torch.manual_seed(0)
    model = tmp_path / "tiny"
    Transformer(TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True)) \
        .eval().save(model)
    torch.set_num_threads(1)
    codes = run_world(2, model, tmp_path / "tp", torchrun=True, worker=WORKER, timeout=600)
    assert [c["code"] for c in codes] == [0, 0], codes
    code, _, err = run_cli(["circuit", "--model", str(model), *circuit_worker.ARGS, "--out", tmp_path / "one"], capsys)
    assert code == 0, err
    tp, one = tmp_path / "tp" / "circuit", tmp_path / "one"
    a, b = EdgeScores.load(tp / "scores.json"), EdgeScores.load(one / "scores.json")
    assert a.edges == b.edges and a.n_examples == b.n_examples == 5
    scale = float(b.values.abs().max())
    assert float((a.values - b.values).abs().max()) <= 1e-5 * scale
    assert a.clean == pytest.approx(b.clean, rel=1e-5) and a.corrupted == pytest.approx(b.corrupted, rel=1e-5)
    assert any("split across the ranks" in n for n in a.notes)
    assert Circuit.load(tp / "circuit.json").edges == Circuit.load(one / "circuit.json").edges
    fa, fb = Faithfulness.load(tp / "faithfulness.json"), Faithfulness.load(one / "faithfulness.json")
    assert fa.sizes == fb.sizes and fa.f == pytest.approx(fb.f, rel=1e-5, abs=1e-6)
