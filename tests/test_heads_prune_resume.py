"""``headlab heads prune --resume``: Ctrl-C keeps the finished units in OUT/heads-prune.partial.json (and the pruned
model, once made), the printed command pasted back runs only the rest, and the folder it finishes equals an
uninterrupted run's: the same heads removed, the same weights, the same curve."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from safetensors.torch import load_file

import headlab
import headlab.cli.main  # noqa: F401  (every command, so every instrument, registered)
import headlab.interpret.heads.prune as P
from conftest import run_cli
from headlab.interpret.heads.units import ImportanceUnits
from headlab.models.transformer import Transformer, TransformerConfig

V = 40


@pytest.fixture()
def saved(tmp_path):
    torch.manual_seed(1)
    path = tmp_path / "tiny"
    Transformer(TransformerConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True)).eval() \
        .save(path)
    return path


@pytest.fixture()
def ids(tmp_path):
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, V, (int(k),), generator=g) for k in torch.randint(4, 10, (7,), generator=g)]
    path = tmp_path / "ids.txt"
    path.write_text("\n".join(" ".join(str(int(x)) for x in t) for t in texts) + "\n")
    return path


def _args(saved, ids, out):
    return ["heads", "prune", "--model", saved, "--data", ids, "--batch-size", "2", "--fraction", "0.25", "--curve",
            "--out", out]


def _pasted(err: str) -> list[str]:
    """The command the interrupted line prints, as a user pastes it back (without the leading ``headlab``)."""
    line = [ln for ln in err.splitlines() if ln.startswith("interrupted")][0]
    command = line.split("to finish the rest: ", 1)[1]
    assert command.startswith("headlab heads prune ") and command.endswith(" --resume"), command
    return shlex.split(command)[1:]


def _same_folder(got, want, original) -> None:
    """Two prune folders hold the same files, the same pruned weights and curve, and a model the pruning changed."""
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
    weights = [p.name for p in want.iterdir() if p.suffix == ".safetensors"]
    assert weights
    for name in weights:
        a, b = load_file(got / name), load_file(want / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert json.loads((got / "curve.json").read_text()) == json.loads((want / "curve.json").read_text())
    x = torch.arange(1, 9).view(1, -1)
    g, w = headlab.load(got), headlab.load(want)
    assert g.adapter.layer_heads == w.adapter.layer_heads
    assert torch.equal(g.adapter.forward(x).logits, w.adapter.forward(x).logits)
    assert not torch.equal(g.adapter.forward(x).logits, headlab.load(original).adapter.forward(x).logits)


def test_an_interrupted_prune_resumes_to_the_uninterrupted_folder(saved, ids, tmp_path, capsys, monkeypatch):
    real, calls = ImportanceUnits.run, []

    def third_batch_interrupted(self, i, before=None):
        calls.append(i)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the third importance batch
        return real(self, i, before)

    monkeypatch.setattr(ImportanceUnits, "run", third_batch_interrupted)
    out = tmp_path / "o"
    code, _, err = run_cli(_args(saved, ids, out), capsys)
    kept = out / "heads-prune.partial.json"
    # 7 examples, 2 per batch: 4 importance batches, the surgery, the curve
    assert code == 130 and f"interrupted: kept 2 of 6 units in {kept}; run again with --resume" in err, err
    assert sorted(p.name for p in out.iterdir()) == [kept.name]  # no model yet: the units alone
    partial = json.loads(kept.read_text())
    assert partial["interrupted"] == {"kept": 2, "of": 6}
    assert list(partial["units"]) == ["importance batch 0", "importance batch 1"]

    code, _, again = run_cli(_args(saved, ids, out), capsys)  # without --resume: refused, and told how
    assert code == 2 and "not an empty folder" in again and "add --resume" in again, again

    calls.clear()
    monkeypatch.setattr(ImportanceUnits, "run", lambda self, i, before=None: calls.append(i) or real(self, i, before))
    code, said, err = run_cli(_pasted(err), capsys)
    assert code == 0, err
    assert calls == [2, 3]  # only the rest of the importance ran
    assert not kept.exists()  # finished: the folder is the result

    calls.clear()
    code, fresh_said, err = run_cli(_args(saved, ids, tmp_path / "fresh"), capsys)
    assert code == 0 and calls == [0, 1, 2, 3], err
    _same_folder(out, tmp_path / "fresh", saved)
    assert said == fresh_said.replace(str(tmp_path / "fresh"), str(out))  # the same lines, the folder aside

    code, _, err = run_cli([*_args(saved, ids, out), "--resume"], capsys)  # a finished folder has nothing to resume
    assert code == 2 and "holds no interrupted prune" in err, err


def test_a_prune_interrupted_in_the_curve_keeps_the_model_and_resumes_the_curve(saved, ids, tmp_path, capsys,
                                                                               monkeypatch):
    real, curves = P.pruning_curve, []

    def interrupted_once(*a, **k):
        curves.append(k["importance"])
        if len(curves) == 1:
            raise KeyboardInterrupt  # Ctrl-C in the curve, after the surgery
        return real(*a, **k)

    monkeypatch.setattr(P, "pruning_curve", interrupted_once)
    out = tmp_path / "o"
    code, _, err = run_cli(_args(saved, ids, out), capsys)
    assert code == 130 and f"interrupted: kept 5 of 6 units in {out}" in err, err
    assert (out / "heads-prune.partial.json").is_file() and (out / "headlab_pruned.json").is_file()  # the model, saved

    monkeypatch.setattr(ImportanceUnits, "run", lambda *a, **k: pytest.fail("importance ran again"))
    code, _, err = run_cli(_pasted(err), capsys)
    assert code == 0, err
    assert len(curves) == 2 and torch.equal(curves[0], curves[1])  # the curve ranked by the kept importance
    monkeypatch.undo()
    code, _, err = run_cli(_args(saved, ids, tmp_path / "fresh"), capsys)
    assert code == 0, err
    _same_folder(out, tmp_path / "fresh", saved)
