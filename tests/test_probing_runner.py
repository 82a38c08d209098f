"""``headlab.probe`` runs through the study runner (``runner.call("probe", ...)``): the progress it is given sees
the instrument's units (each batch of sentences, then each batch of the gradient test), its options are checked
before the model loads in their Python names, a treebank already read is handed over as it is, and the result
equals :class:`ProbeRun`'s units computed one by one and added."""

from __future__ import annotations

import numpy as np
import pytest
from test_probing import CONLLU, tiny_llama

import headlab
from headlab.errors import ConfigError, InputError
from headlab.interpret.probing import head_scores
from headlab.interpret.probing.head_scores import ProbeRun
from headlab.interpret.probing.treebank import read_treebank
from headlab.interpret.study import runner

FIGURES = ("accuracy", "count", "visible", "baseline_accuracy", "baseline_offset", "head_map")
SETTINGS = {"head_map_sentences": 3, "grad_sentences": 2}


@pytest.fixture
def treebank(tmp_path, monkeypatch):
    monkeypatch.setattr(head_scores, "MAX_BATCH", 1)  # every sentence its own batch: several units
    p = tmp_path / "tb.conllu"
    p.write_text(CONLLU * 2, encoding="utf-8")  # 4 sentences that probe, 4 skipped
    return p


def _same(got, want) -> None:
    for name in FIGURES:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert got.per_head.keys() == want.per_head.keys()
    for name, v in want.per_head.items():
        np.testing.assert_array_equal(got.per_head[name], v, err_msg=name)
    assert (got.sentences, got.tokens, got.grad_note, got.notes, got.skipped) == \
        (want.sentences, want.tokens, want.grad_note, want.notes, want.skipped)


def test_probe_is_the_instruments_units_through_the_runner(treebank, monkeypatch):
    loaded = tiny_llama()
    calls, seen = [], []
    real = runner.call
    monkeypatch.setattr(runner, "call", lambda name, options, **kw: (calls.append((name, options)), real(
        name, options, **kw))[1])
    got = headlab.probe(loaded, treebank, progress=lambda stage, done, total: seen.append((stage, done, total)),
                        **SETTINGS)
    assert [name for name, _ in calls] == ["probe"] and calls[0][1]["model"] is loaded

    run = ProbeRun(loaded, treebank, **SETTINGS)  # the units, computed one by one here
    keys = run.units()
    assert keys == [f"batch {i}" for i in range(1, 5)] + ["gradients 1", "gradients 2"]
    assert seen == [("batches", i, len(keys)) for i in range(1, len(keys) + 1)]  # the runner's stage per unit
    _same(got, run.finish({k: run.unit(k) for k in keys}))
    assert got.sentences == 4 and np.isfinite(got.per_head["grad_sep"]).all()

    tb = read_treebank(treebank)  # a treebank already read goes over as it is: not read again
    monkeypatch.setattr("headlab.reading.read_conllu", lambda *a, **k: pytest.fail("the treebank was read again"))
    _same(headlab.probe(loaded, tb, **SETTINGS), got)


def test_python_options_are_checked_before_the_load_in_their_names(treebank, no_load):
    with pytest.raises(InputError, match=r"^grad_sentences must be 0 or more, got -1$"):
        headlab.probe("minilm", treebank, grad_sentences=-1)
    with pytest.raises(ConfigError, match=r"^limit must be at least 1 sentence, got 0$"):
        headlab.probe("minilm", treebank, limit=0)
    with pytest.raises(InputError, match=r"'poss' does not occur"):  # the treebank against --relations: no load
        headlab.probe("minilm", treebank, relations="det,poss")
