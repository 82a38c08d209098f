"""``headlab.atlas`` runs the ``atlas`` instrument through the study runner (``runner.call``): its progress is the
runner's count of the atlas's units, its numbers are those of the units computed directly (``AtlasRun``, no
runner), its arguments are checked before the load in their own names, and ``resume=PATH`` is the runner's
checkpoint (an interrupted run leaves the runner's file of finished units; the rerun computes only the rest)."""

from __future__ import annotations

import pytest
import torch

import headlab
from headlab.errors import ConfigError
from headlab.interpret.atlas import atlas
from headlab.interpret.atlas.run import AtlasRun
from headlab.interpret.study import runner
from headlab.models.transformer import Transformer, TransformerConfig
from headlab.results import Result

TEXTS = [[(7 * i) % 37 + 1 for i in range(150)]]
SMALL = dict(texts=TEXTS, kinds=["induction", "sink"], k=2, n_draws=2, half=6, n_repeated=2, max_tokens=16,
             n_texts=2, n_boot=20, seed=3)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True)
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def direct(model):
    """The atlas from its units, computed here one after the other without the runner: (the units, the atlas)."""
    run = AtlasRun(model, **SMALL)
    values: dict = {}
    for key in run.units():
        values[key] = run.unit(key, values)
    return run.units(), run.finish(values)


def _same(a, b):
    assert a.kinds == b.kinds
    for kind in b.scores:
        assert torch.allclose(a.scores[kind], b.scores[kind], atol=1e-12, equal_nan=True), kind
    assert a.verdicts == b.verdicts and a.evidence.keys() == b.evidence.keys()


def test_the_atlas_runs_through_the_runner_to_the_units_numbers(model, direct, monkeypatch):
    calls, seen = [], []
    real = runner.call
    monkeypatch.setattr(runner, "call", lambda name, options, **kw: calls.append((name, options)) or real(
        name, options, **kw))
    got = atlas(model, progress=lambda stage, done, total: seen.append((stage, done, total)), **SMALL)
    assert [name for name, _ in calls] == ["atlas"] and calls[0][1]["draws"] == 2 and calls[0][1]["top_k"] == 2
    units, want = direct
    assert units == ["repeated", "copying", "text", "check repeated", "check text", "evidence"]
    # the runner counts the units as they end, beside each phase's own stages
    assert [x for x in seen if x[0] == "atlas phases"] == [("atlas phases", i + 1, len(units)) for i in
                                                           range(len(units))]
    assert any(stage == "causal checks (text)" for stage, _, _ in seen)  # and each phase's own stages
    _same(got, want)
    assert got.settings["n_draws"] == 2 and got.settings["k"] == 2 and got.settings["seed"] == 3


@pytest.mark.parametrize("bad,match", [
    (dict(n_draws=0), r"^n_draws must be at least 1, got 0$"),
    (dict(n_draws=1001), r"^n_draws must be at most 1,000"),
    (dict(k=0), r"^k must be at least 1, got 0$"),
    (dict(needle_trials=0), r"^needle_trials must be at least 1, got 0$"),
    (dict(haystack_tokens=7), r"^haystack_tokens must be at least 8, got 7$"),
    (dict(window=1), r"^window must be an integer of at least 2, got 1$"),
    (dict(n_boot=1.5), r"^n_boot must be an integer of at least 2, got 1.5$"),
    (dict(kinds=["induction", "inductoin"]), r"^unknown atlas kind\(s\) 'inductoin'; choose from previous_token"),
])
def test_arguments_are_refused_before_the_load_in_their_own_names(bad, match, no_load):
    with pytest.raises(ConfigError, match=match):
        headlab.atlas("minilm", **bad)


def test_resume_is_the_runners_checkpoint(model, direct, tmp_path, monkeypatch):
    import headlab.interpret.atlas.run as R

    path = tmp_path / "ckpt"  # not a .json name: the runner keeps the units beside it, in ckpt.partial.json
    kept = tmp_path / "ckpt.partial.json"

    def stop(stage, done, total):
        if stage == "causal checks (text)":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atlas(model, progress=stop, resume=path, **SMALL)
    partial = Result.load(kept)  # the runner's file: the kind, the run's settings, the finished units
    assert partial.kind == "head_atlas" and partial.figures["interrupted"] == {"kept": 4, "of": 6}
    assert list(partial.figures["units"]) == ["repeated", "copying", "text", "check repeated"]
    assert partial.settings["draws"] == 2 and partial.settings["n_boot"] == 20 and not path.exists()

    monkeypatch.setattr(R, "_repeated_scores", lambda *a, **k: pytest.fail("the repeated phase ran again"))
    ran = []
    real = AtlasRun.unit
    monkeypatch.setattr(AtlasRun, "unit", lambda self, key, values: ran.append(key) or real(self, key, values))
    again = atlas(model, resume=path, **SMALL)
    assert ran == ["check text", "evidence"] and not kept.exists()  # the rest only; complete: the file is gone
    assert again.notes[-1] == f"resumed: repeated, copying, text, check repeated read back from {kept}"
    _same(again, direct[1])


def test_a_checkpoint_of_other_inputs_is_replaced(model, direct, tmp_path):
    path = tmp_path / "atlas.json"
    other = dict(SMALL, texts=[[(5 * i) % 37 + 1 for i in range(150)]])  # the same settings, other text
    def stop(stage, done, total):
        if stage == "evidence maps":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atlas(model, progress=stop, resume=path, **other)
    assert len(Result.load(path).figures["units"]) == 5
    got = atlas(model, resume=path, **SMALL)
    assert got.notes[-1] == f"{path} held another run's units (other settings or inputs); they were replaced"
    assert not any(n.startswith("resumed:") for n in got.notes) and not path.exists()
    _same(got, direct[1])
