"""``headlab heads prune`` is a row: the registered ``heads-prune`` instrument's options are the command's, a bad
option is refused before any load, Ctrl-C in the curve keeps the finished pruning unit and says what was
written, and what the row removes and writes is what the library computes."""

from __future__ import annotations

import json

import pytest
import torch

import headlab
import headlab.cli.main  # noqa: F401  (every command, so every instrument, registered)
from conftest import command_params, run_cli
from headlab.interpret.instruments import REQUIRED, get, runner
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
    texts = [torch.randint(0, V, (int(k),), generator=g) for k in torch.randint(4, 10, (6,), generator=g)]
    path = tmp_path / "ids.txt"
    path.write_text("\n".join(" ".join(str(int(x)) for x in t) for t in texts) + "\n")
    return path


def test_prune_is_a_row_of_its_instrument():
    inst = get("heads-prune")
    params = command_params("heads", "prune")
    for o in inst.options:
        p = params.pop(o.name)
        assert set(p.opts) == {o.flag} | ({o.short} if o.short else set())
        assert p.required if o.default is REQUIRED else p.default == o.default
    params.pop("resume")  # an interrupted prune goes on from its kept units (tests/test_heads_prune_resume.py)
    assert params == {}  # no --tensor-parallel: the pruned model is saved from one process
    assert "one process" in inst.sharded


@pytest.mark.parametrize("args, said", [
    (["--fraction", "0.5"], "--data FILE is required: a .tsv, .conllu or .txt of examples"),
    (["--heads", "0.9"], "--heads 0.9 is out of range: head 0.9 does not exist: the model has layers 0..1 and heads 0..3"),
    (["--heads", "0-1"], "--heads expects LAYER.HEAD,... (e.g. 0.3,2.5); got '0-1'"),
    (["--heads", "0.1", "--loss", "bogus"], "--loss 'bogus' is not a loss"),
    (["--heads", "0.1", "--tensor-parallel"], "No such option: --tensor-parallel"),
    (["--heads", "0.1", "--data", "{tmp}/none.tsv"], "--data '{tmp}/none.tsv' does not exist"),
])
def test_a_bad_option_is_refused_before_any_load(args, said, saved, tmp_path, capsys, no_load):
    argv = ["heads", "prune", "--model", saved, "--out", tmp_path / "o", *(a.format(tmp=tmp_path) for a in args)]
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and said.format(tmp=tmp_path) in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_ctrl_c_in_the_curve_keeps_the_finished_pruning_unit(saved, ids, tmp_path, monkeypatch):
    """Two units, the pruning then the curve: interrupted in the curve, the runner keeps the first, the instrument
    saves that pruned model into the folder (as the command did before it was a row), and the line says where; the
    saved model reloads with the heads removed."""
    import headlab.interpret.heads.prune as P

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(P, "pruning_curve", interrupted)
    said = []
    out = runner.run("heads-prune", {"model": str(saved), "out": tmp_path / "o", "heads": "0.1,1.2", "data": ids,
                                     "curve": True}, say=said.append)
    assert out.interrupted and (out.kept, out.total) == (1, 2) and out.result is None
    assert len(said) == 1 and said[0].startswith(f"interrupted: kept 1 of 2 units in {tmp_path / 'o'}"), said
    assert said[0].endswith("run again with --resume to finish the rest"), said  # the units in heads-prune.partial.json
    from headlab.interpret.heads.prune import prune_heads

    kept, direct = headlab.load(tmp_path / "o"), prune_heads(headlab.load(saved), {0: [1], 1: [2]})
    x = torch.arange(1, 9).view(1, -1)
    assert kept.adapter.layer_heads == direct.adapter.layer_heads
    torch.testing.assert_close(kept.adapter.forward(x).logits, direct.adapter.forward(x).logits)


def test_the_row_removes_the_least_important_share_and_writes_the_library_curve(saved, ids, tmp_path, capsys):
    from headlab.interpret.heads.examples import read_texts, token_ids_if_needed
    from headlab.interpret.heads.importance import head_importance
    from headlab.interpret.heads.prune import pruning_curve

    out = tmp_path / "pr"
    code, so, err = run_cli(["heads", "prune", "--model", saved, "--fraction", "0.25", "--data", ids, "--curve",
                             "--out", out, "--json"], capsys)
    assert code == 0, err
    summary = json.loads(so)
    loaded = headlab.load(saved)
    texts = token_ids_if_needed(loaded, read_texts(ids)[0])
    imp = head_importance(loaded, texts, loss="auto", normalize=True)  # (layers, heads)
    lowest = {divmod(int(i), imp.shape[1]) for i in torch.argsort(imp.flatten())[:2]}  # 25% of 8 heads
    assert {(int(l), h) for l, hs in summary["removed"].items() for h in hs} == lowest
    assert headlab.load(out).adapter.layer_heads == summary["heads_per_layer"]
    curve = pruning_curve(loaded, texts, loss="auto")
    written = json.loads((out / "curve.json").read_text())
    assert written["values"] == pytest.approx(curve.values, rel=1e-6) and summary["curve"] == curve.summary()
    assert (out / "curve.png").is_file() and (out / "heads.html").is_file()
