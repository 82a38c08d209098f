"""`headlab train-classifier` / headlab.models.finetune on a few sentences of our own: it trains,
saves a folder headlab loads as a classifier, reports the validation accuracy the saved model
really has, and refuses bad input before any training."""

from __future__ import annotations

import json

import pytest
import torch

import headlab
from headlab.errors import InputError
from headlab.models.finetune import TrainingConfig, train_classifier
from conftest import run_cli

POS = ["a gripping , funny film", "warm and clever", "a joy to watch", "the best film this year", "wonderful acting"]
NEG = ["a dull , flat script", "boring and far too long", "a waste of time", "the worst film this year", "awful acting"]


def _tsv(path, rows):
    path.write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("ft")
    train = _tsv(d / "train.tsv", [(t, 1) for t in POS] * 2 + [(t, 0) for t in NEG] * 2)
    val = _tsv(d / "validation.tsv", [(t, 1) for t in POS] + [(t, 0) for t in NEG])
    r = train_classifier(train, val, out=d / "clf", config=TrainingConfig(batch_size=4, subset=0, lr=5e-4))
    return r, val


def test_trains_saves_and_reports_the_accuracy_the_saved_model_has(trained):
    r, val = trained
    assert r.steps == 5 and r.train_sentences == 20 and r.validation_sentences == 10
    loaded = headlab.load(r.out)
    assert type(loaded.model).__name__ == "BertForSequenceClassification"
    enc = loaded.encode(POS + NEG)
    with torch.no_grad():
        pred = loaded.model(**enc).logits.argmax(-1)
    acc = float((pred == torch.tensor([1] * 5 + [0] * 5)).float().mean())
    assert r.validation_accuracy == pytest.approx(acc)
    record = json.loads((r.out / "headlab-training.json").read_text())
    assert record["validation_accuracy"] == r.validation_accuracy and record["config"]["seed"] == 0


def test_refusals_before_training(trained, tmp_path, capsys):
    r, val = trained
    with pytest.raises(InputError, match="exists and is not empty.*--force"):
        train_classifier(val, val, out=r.out)
    with pytest.raises(InputError, match="label 2 is not 0 or 1"):
        train_classifier(_tsv(tmp_path / "bad.tsv", [("a film", 2)]), val, out=tmp_path / "o")
    code, _, err = run_cli(["train-classifier", "--data", tmp_path / "nowhere"], capsys)
    assert code == 2 and "does not exist" in err and err.count("\n") == 1
