"""The library's :func:`headlab.explain`, the explain study (:func:`headlab.interpret.saliency.study`) and
:func:`headlab.analyze` run their instruments through the study runner (:func:`headlab.interpret.study.runner.call`),
and what they return equals the instruments' units computed directly: the one explanation
(:func:`~headlab.interpret.saliency.explanation.explanation`), each dataset row's record
(:func:`~headlab.interpret.saliency.corpus_study.instance`) with the tables made from them
(:func:`~headlab.interpret.saliency.corpus_study.conclude`), and the report's phases (plan, one recording, the
sections, the folder)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers

from headlab.errors import ConfigError, InputError
from headlab.interpret.study import runner

TEXT = "a gripping , funny and moving film"
ROWS = ["a gripping film", "a dull , boring film", "funny"]


@pytest.fixture(scope="module")
def clf():
    from headlab.models.loader import LoadedModel, adapt
    from headlab.models.named_models import minilm_dir

    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, attn_implementation="eager",
                                  num_labels=2)
    model = transformers.BertForSequenceClassification(cfg).double().eval()
    adapter = adapt(model)
    return LoadedModel(model, tok, adapter, "tiny-bert-clf", adapter.family, 64)


@pytest.fixture
def calls(monkeypatch):
    """The instruments runner.call ran (the real call still runs)."""
    seen: list[str] = []
    real = runner.call

    def spy(instrument, options, **kw):
        seen.append(instrument)
        return real(instrument, options, **kw)

    monkeypatch.setattr(runner, "call", spy)
    return seen


def test_explain_runs_the_instrument_and_equals_the_unit(clf, calls):
    from headlab.interpret.saliency import explain
    from headlab.interpret.saliency.explanation import explanation

    kw = dict(methods=("attention", "integrated_gradients"), ig_steps=4, attention_layers="last",
              ig_method="riemann_middle")
    got = explain(clf, TEXT, **kw)
    assert calls == ["explain"]
    want = explanation(clf, TEXT, **kw)
    assert got.tokens == want.tokens and got.target == want.target and got.methods == want.methods
    for m in want.methods:
        torch.testing.assert_close(torch.tensor(got.scores[m]), torch.tensor(want.scores[m]), rtol=0, atol=0)
    # the library's own settings reached the unit: one layer of attention rows, the midpoint rule's gap
    assert len(got.attention_layers) == 1 and got.completeness_gap == want.completeness_gap
    other = explanation(clf, TEXT, **{**kw, "methods": ("integrated_gradients",), "ig_method": "gausslegendre"})
    assert got.completeness_gap != other.completeness_gap


def test_explain_keeps_the_librarys_words(clf):
    from headlab.interpret.saliency import explain

    with pytest.raises(InputError, match="text must be a string, got int"):
        explain(clf, 3)
    with pytest.raises(InputError, match=r"target -1 is out of range"):  # the library's check, not --target's
        explain(clf, TEXT, target=-1, methods=("gradient",))
    with pytest.raises(ConfigError, match="explain needs a LoadedModel"):
        explain(object(), TEXT, methods=("gradient",))
    with pytest.raises(ConfigError, match=r"^ig_steps must be at most 10,000"):  # named as Python names it
        explain(clf, TEXT, ig_steps=10**6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explain(clf, TEXT, methods=("integrated_gradients",), ig_steps=1, warn=False)
    assert not caught


def _data(tmp_path):
    p = tmp_path / "d.tsv"
    p.write_text("sentence\tlabel\n" + "".join(f"{t}\t{i % 2}\n" for i, t in enumerate(ROWS)), encoding="utf-8")
    return p


def test_study_runs_the_rows_as_units_and_equals_them(clf, tmp_path, calls):
    from headlab.interpret.saliency import StudyOptions, study
    from headlab.interpret.saliency.corpus_study import conclude, instance, read_dataset

    data = _data(tmp_path)
    opts = StudyOptions(methods=("attention", "gradient"), permutations=6,
                        adversarial_steps=2, bootstrap=50)
    seen = []
    r = study(clf, data, tmp_path / "out", options=opts, figures=False,
              progress=lambda stage, done, total: seen.append((stage, done, total)))
    assert calls == ["explain"]
    assert seen == [("explain", k, len(ROWS)) for k in range(1, len(ROWS) + 1)]  # the runner's units: the rows
    units = json.loads((tmp_path / "out" / "instances.json").read_text())
    rows = read_dataset(data)
    want = [instance(clf, row, opts) for row in rows]  # each row's record, computed directly
    assert list(units["units"]) == [row.key for row in rows]
    for w in want:
        got = units["units"][w["key"]]
        assert got["pred"] == w["pred"] and got["tokens"] == w["tokens"]
        for m, scores in w["scores"].items():
            torch.testing.assert_close(torch.tensor(got["scores"][m]), torch.tensor(scores), rtol=1e-12, atol=0)
        assert got["permutation"] == pytest.approx(w["permutation"], rel=1e-12)
    direct = conclude(clf, data, tmp_path / "direct", want, opts, figures=False)
    assert r.instances == direct.instances == len(ROWS) and r.files == ["instances.json", "study.json"]
    assert r.tables == {**direct.tables, "dataset": str(data)}  # the same records give the same tables
    # the library's settings are written as they were: its StudyOptions, the dataset and the limit
    assert units["headlab"]["settings"] == {**opts.to_json(), "dataset": str(data), "limit": None}
    again = study(clf, data, tmp_path / "out", options=opts, figures=False, progress=False, limit=1)  # replaced
    assert again.instances == 1 and len(json.loads((tmp_path / "out" / "instances.json").read_text())["units"]) == 1


def test_study_time_budget(clf, tmp_path):
    from headlab.interpret.saliency import StudyOptions, study

    opts = StudyOptions(methods=("gradient",), counterfactual=False, bootstrap=10)
    r = study(clf, _data(tmp_path), tmp_path / "out", options=opts, progress=False, figures=False, max_seconds=0)
    assert r.instances == 0 and r.skipped == [f"time budget of 0 s reached: {len(ROWS)} of {len(ROWS)} rows not run"]
    assert json.loads((tmp_path / "out" / "instances.json").read_text())["units"] == {}  # a rerun explains them


def test_analyze_runs_the_instrument_and_equals_its_phases(clf, tmp_path, calls):
    from headlab.interpret.heads.labels import LabelThresholds
    from headlab.interpret.report import analyze_job
    from headlab.interpret.report.folder import write_report

    thresholds = LabelThresholds(broad=1.01)  # no head is broad (a normalised entropy is at most 1)
    notes = {(1, 2): "a finding of another study"}
    stages = []
    got = analyze_job.analyze(TEXT, model=clf, out_dir=tmp_path / "r", thresholds=thresholds, annotations=notes,
                              progress=stages.append)  # the older progress(message) form still works
    assert calls[0] == "analyze" and any(s.startswith("capturing attention maps") for s in stages)
    job, sections, planned = analyze_job.plan(clf, TEXT, tmp_path / "d", thresholds=thresholds, annotations=notes)
    results = analyze_job.compute(job, sections, analyze_job.record_once(job, sections))
    (tmp_path / "d").mkdir()
    want = write_report(job, sections, results, planned)
    assert [r.as_dict() for r in got.records] == [r.as_dict() for r in want.records]
    assert got.tokens == want.tokens and got.mode == want.mode and got.drawn == want.drawn
    assert got.record(1, 2).notes == ("a finding of another study",) and got.record(0, 0).notes == ()
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted(p.name for p in (tmp_path / "d").iterdir())
    # the thresholds reached the labels: no head is broad at 1.01, though the default 0.7 would call some broad
    assert not any("broad" in r.labels for r in got.records) and any(r.norm_entropy >= 0.7 for r in got.records)
