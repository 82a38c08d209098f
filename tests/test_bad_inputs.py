"""The last bad inputs a new user met: each is a typed error that says what was seen and what to do,
and on the command line exit 2 with one line, before any model is loaded (checked by making a load
fail the test)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import headlab
from headlab.errors import ConfigError, DeviceError, HeadlabError, InputError, ShapeError
from conftest import run_cli


@pytest.fixture
def no_load(monkeypatch):
    """Any model load fails the test: the command must refuse before it."""
    def boom(*a, **k):
        raise AssertionError("a model was loaded before the bad option was refused")

    import headlab.models
    import headlab.models.loader

    monkeypatch.setattr(headlab, "load", boom)  # first: headlab caches its lazy names, so it must cache the real one
    monkeypatch.setattr(headlab.models.loader, "load", boom)
    monkeypatch.setattr(headlab.models, "load", boom)


def _tsv(tmp_path, body, name="d.tsv"):
    p = tmp_path / name
    p.write_text(body)
    return p


CLI_CASES = [
    # (args, what stderr says)
    (["heads", "prune", "--model", "minilm", "--heads", "9.9", "--out", "{tmp}/o"], r"head 9\.9 does not exist.*layers 0\.\.5"),
    (["heads", "prune", "--model", "minilm", "--heads", "0.12", "--out", "{tmp}/o"], r"heads 0\.\.11"),
    (["heads", "prune", "--model", "minilm", "--heads", "0.1", "--gqa", "bogus", "--out", "{tmp}/o"], r"--gqa 'bogus'"),
    (["heads", "ablate", "--model", "minilm", "--data", "{data}", "--kind", "bogus"], r"--kind 'bogus'.*zero, mean"),
    (["heads", "ablate", "--model", "minilm", "--data", "{data}", "--boot", "0"], r"at least 2, got 0"),
    (["analyze", "the cat", "--heads", "0.99", "--out", "{tmp}/r"], r"head 0\.99 does not exist"),
    (["heads", "importance", "--model", "minilm", "--data", "{nocol}"], r"no 'sentence' or 'text' column"),
]


@pytest.mark.parametrize("args,match", CLI_CASES, ids=lambda x: " ".join(x[:4]) if isinstance(x, list) else None)
def test_cli_refuses_before_loading(args, match, tmp_path, capsys, no_load):
    data = _tsv(tmp_path, "sentence\tlabel\nthe cat sat\t1\na dog\t0\n")
    nocol = _tsv(tmp_path, "label\tfoo\n1\tthe cat\n", "nocol.tsv")
    argv = [a.format(tmp=tmp_path, data=data, nocol=nocol) for a in args]
    code, out, err = run_cli(argv, capsys)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("error:"), err
    import re

    assert re.search(match, err), err


def test_environment_is_read_before_any_work(monkeypatch, capsys, no_load, tmp_path):
    monkeypatch.setenv("HEADLAB_NATIVE", "banana")
    code, _, err = run_cli(["analyze", "the cat", "--out", tmp_path / "r"], capsys)
    assert code == 2 and "HEADLAB_NATIVE='banana' is not 0 or 1" in err
    from headlab.attention.backends import native

    with pytest.raises(ConfigError, match="HEADLAB_NATIVE"):
        native.enabled()
    monkeypatch.setenv("HEADLAB_NATIVE", "0")
    assert native.enabled() is False


def test_unwritable_cache_is_a_typed_error(monkeypatch, tmp_path):
    from headlab.models.cache import writable_cache_dir

    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("HEADLAB_CACHE", str(blocker / "cache"))  # a folder under a file cannot be made
    with pytest.raises(ConfigError, match=r"HEADLAB_CACHE .* is not writable.*set HEADLAB_CACHE"):
        writable_cache_dir("smollm2-135m-instruct")
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path / "ok"))
    assert writable_cache_dir("x") == tmp_path / "ok" / "x" and (tmp_path / "ok").is_dir()


def test_library_inputs():
    m = headlab.MultiHeadAttention(16, 4)
    m.head_gate = torch.ones(3)
    with pytest.raises(ShapeError, match=r"head_gate has shape \(3,\) but the module has 4 heads"):
        m(torch.randn(1, 5, 16))
    for dev, match in (("banana", "unknown device 'banana'"), ("cuda:7", "not available")):
        if dev.startswith("cuda") and torch.cuda.device_count() > 7:
            continue
        with pytest.raises(DeviceError, match=match):
            headlab.load("minilm", device=dev)


def test_encode_and_token_ids(tmp_path):
    from test_probing import tiny_bert

    lm = tiny_bert()
    for bad in (None, 5):
        with pytest.raises(InputError, match="encode takes a text or a list of texts"):
            lm.encode(bad)
    n = lm.model.get_input_embeddings().num_embeddings
    for ids in (torch.tensor([[1, n]]), torch.tensor([[-1, 2]])):
        with pytest.raises(InputError, match=rf"outside the vocabulary of {n} tokens"):
            headlab.capture(lm, {"input_ids": ids}, "blocks.*.attn.pattern")
    headlab.capture(lm, {"input_ids": torch.tensor([[1, n - 1]])}, "blocks.*.attn.pattern")  # the edge is fine


def test_ablation_on_one_example_says_its_intervals_cannot_be_estimated():
    from headlab.interpret.heads.ablation import ablate
    from headlab.models.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=30, d_model=16, n_layers=2, n_heads=2, causal=True)).eval()
    r = ablate(m, [torch.randint(0, 30, (8,))], loss="lm", k=2, n_boot=50, cka=False)
    assert np.isnan(r.noise_floor) and torch.isnan(r.single_ci).all() and torch.isfinite(r.single).all()
    assert any("no interval and no noise floor can be estimated" in n for n in r.notes)
    assert r.floor_text() == "n/a (1 example)"
    doc = json.loads(json.dumps(r.to_json(), allow_nan=False))  # standard JSON: n/a is null
    assert doc["noise_floor"] is None and doc["single_ci"][0][0] == [None, None]
    two = ablate(m, [torch.randint(0, 30, (8,)), torch.randint(0, 30, (8,))], loss="lm", k=2, n_boot=50, cka=False)
    assert np.isfinite(two.noise_floor) and torch.isfinite(two.single_ci).all()
    for bad in (0, 1, 2.5, True):
        with pytest.raises(ConfigError, match="n_boot"):
            ablate(m, [torch.randint(0, 30, (8,))] * 2, loss="lm", n_boot=bad)


def test_outputs_are_not_overwritten_silently(tmp_path, capsys, no_load):
    (tmp_path / "ex").mkdir()
    (tmp_path / "ex" / "explanation.html").write_text("earlier work")
    code, _, err = run_cli(["explain", "a film", "--model", "minilm", "--out", tmp_path / "ex"], capsys)
    assert code == 2 and "not empty" in err and "--force" in err
    out = tmp_path / "b.json"
    out.write_text("[]")
    code, _, err = run_cli(["bench", "attention", "--seq-lens", "16", "--backends", "sdpa", "--json", out], capsys)
    assert code == 2 and "exists" in err and "--force" in err
    assert out.read_text() == "[]"


def test_read_texts_needs_its_column(tmp_path):
    from headlab.interpret.heads.examples import read_texts

    with pytest.raises(InputError, match=r"no 'sentence' or 'text' column; the header has \['label', 'foo'\]"):
        read_texts(_tsv(tmp_path, "label\tfoo\n1\tthe cat\n"))
    texts, labels = read_texts(_tsv(tmp_path, "label\ttext\n1\tthe cat\n", "t.tsv"))
    assert texts == ["the cat"] and labels == [1]


def test_every_error_here_is_a_headlab_error():
    for exc in (ConfigError, DeviceError, InputError, ShapeError):
        assert issubclass(exc, HeadlabError)
