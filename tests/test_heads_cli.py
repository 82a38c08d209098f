"""``headlab heads importance|ablate|prune``: --help, error exits (code 2), and an end-to-end run on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

import headlab
from headlab.models.transformer import Transformer, TransformerConfig
from conftest import run_cli

V = 40


def _texts(n=6):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, V, (int(k),), generator=g) for k in torch.randint(4, 10, (n,), generator=g)]


def _decoder():
    torch.manual_seed(1)
    return Transformer(TransformerConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True)).eval()


@pytest.fixture()
def saved_decoder(tmp_path):
    path = tmp_path / "tiny"
    _decoder().save(path)
    return path


def test_cli_help_and_errors(tmp_path, saved_decoder, capsys):
    for sub in ("importance", "ablate", "prune"):
        code, so, se = run_cli(["heads", sub, "--help"], capsys)
        assert code == 0 and "--model" in so
    data = tmp_path / "d.tsv"
    data.write_text("sentence\tlabel\n")
    code, so, se = run_cli(["heads", "importance", "--model", str(saved_decoder), "--data", str(data)], capsys)
    assert code == 2 and "empty" in se
    code, so, se = run_cli(["heads", "importance", "--model", str(saved_decoder), "--data", str(tmp_path / "missing.tsv")], capsys)
    assert code == 2 and "does not exist" in se
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3 4 5\n6 7 8 9\n")
    code, so, se = run_cli(["heads", "importance", "--model", str(saved_decoder), "--data", str(ids), "--loss", "task"], capsys)
    assert code == 2 and "labels" in se
    code, so, se = run_cli(["heads", "prune", "--model", str(saved_decoder), "--heads", "0.0,0.1,0.2,0.3",
                 "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "allow-empty-layers" in se
    code, so, se = run_cli(["heads", "prune", "--model", str(saved_decoder), "--heads", "0.9", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "out of range" in se


def test_cli_runs_end_to_end(tmp_path, saved_decoder, capsys):
    ids = tmp_path / "ids.txt"
    ids.write_text("\n".join(" ".join(str(int(x)) for x in t) for t in _texts(6)) + "\n")
    out = tmp_path / "imp"
    code, so, se = run_cli(["heads", "importance", "--model", str(saved_decoder), "--data", str(ids), "--out", str(out), "--json"], capsys)
    assert code == 0, se
    js = json.loads((out / "importance.json").read_text())
    assert len(js["importance"]) == 2 and (out / "heads.html").is_file()
    code, so, se = run_cli(["heads", "ablate", "--model", str(saved_decoder), "--data", str(ids), "--out", str(tmp_path / "ab"),
                 "--k", "3", "--boot", "50"], capsys)
    assert code == 0, se
    code, so, se = run_cli(["heads", "prune", "--model", str(saved_decoder), "--heads", "0.1,1.2", "--out", str(tmp_path / "pr")], capsys)
    assert code == 0, se
    assert headlab.load(tmp_path / "pr").adapter.layer_heads == [4, 4]  # GQA groups kept even: padded
