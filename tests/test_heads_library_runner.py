"""headlab.head_importance, importance_study and headlab.ablate run their instruments (``heads-importance``,
``heads-ablate``) through the study runner (runner.call): the options they hand over are the instrument's, the
library's settings and the texts in memory are Python-only options (no flag on the command line), messages name
them as Python does, and the numbers equal the instrument's units computed directly, one by one."""

from __future__ import annotations

import pytest
import torch

import headlab
from headlab.errors import ConfigError, InputError
from headlab.interpret.heads.ablation import ablate
from headlab.interpret.heads.importance import head_importance, importance_scores, importance_study
from headlab.interpret.heads.units import AblationUnits, ImportanceUnits
from headlab.interpret.study import runner
from headlab.models.transformer import Transformer, TransformerConfig


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    return Transformer(TransformerConfig(vocab_size=30, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                                         causal=True)).eval()


@pytest.fixture(scope="module")
def texts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 30, (int(n),), generator=g) for n in (6, 9, 5, 8, 7)]


def _calls(monkeypatch) -> list[tuple[str, dict]]:
    seen: list[tuple[str, dict]] = []
    real = runner.call

    def recorded(name, options, *, progress=None):
        seen.append((name, dict(options)))
        return real(name, options, progress=progress)

    monkeypatch.setattr(runner, "call", recorded)
    return seen


def _importance_units(model, texts, **kw) -> tuple[ImportanceUnits, list[dict]]:
    work = ImportanceUnits(model, texts, **kw)
    values: list[dict] = []
    for i in range(len(work.keys())):
        values.append(work.run(i, values[-1] if values else None))
    return work, values


@pytest.mark.parametrize("loss, seed", [("lm", 0), ("kl", 2)])
def test_head_importance_is_the_instrument_s_units(model, texts, monkeypatch, loss, seed):
    seen = _calls(monkeypatch)
    got = head_importance(model, texts, loss=loss, batch_size=2, seed=seed)
    normalized = head_importance(model, texts, loss=loss, batch_size=2, seed=seed, normalize=True)
    assert [name for name, _ in seen] == ["heads-importance"] * 2
    options = seen[0][1]
    assert options["model"] is model and options["texts"] is texts and options["confidence"] is False
    assert options["seed"] == seed and options["loss"] == loss
    work, values = _importance_units(model, texts, loss=loss, batch_size=2, seed=seed, confidence=False)
    assert len(values) == 3  # 5 examples, 2 per batch
    assert torch.equal(got, work.grid(values)) and torch.equal(normalized, work.grid(values, normalize=True))
    by_hand = torch.stack([v["importance"] for v in values]).sum(0) / len(texts)  # E_x |dL/dxi|, added by hand
    torch.testing.assert_close(got, by_hand.float(), atol=0, rtol=1e-6)
    # the library's own loop (one gated pass over every batch, as head_importance ran before the runner, and as the
    # pruning curve still does): the same numbers, bit for bit
    loop = importance_scores(model, texts, None, loss=loss, batch_size=2, normalize=False, backend="auto", seed=seed,
                             max_length=None, progress=False)[0]
    assert torch.equal(got, loop)
    assert torch.isfinite(got).all() and float(got.abs().max()) > 0


def test_importance_study_is_the_instrument_s_units_and_correlates_with_ablation(model, texts, monkeypatch):
    seen = _calls(monkeypatch)
    single = torch.arange(8.0).view(2, 4)
    r = importance_study(model, texts, loss="lm", batch_size=2, single_effects=single)
    assert [name for name, _ in seen] == ["heads-importance"] and seen[0][1]["single_effects"] is single
    work, values = _importance_units(model, texts, loss="lm", batch_size=2)
    ref = work.finish(values, single_effects=single)
    for f in ("importance", "normalized", "confidence"):
        assert torch.equal(getattr(r, f), getattr(ref, f)), f
    assert r.correlations == ref.correlations and set(r.correlations) == {
        "importance~confidence", "importance~ablation", "confidence~ablation"}
    with pytest.raises(ConfigError, match=r"^single_effects must be an \(n_layers, H\) tensor"):
        importance_study(model, texts, loss="lm", single_effects=[[1.0]])


def test_ablate_is_the_instrument_s_units(model, texts, monkeypatch):
    seen = _calls(monkeypatch)
    kw = dict(kind="mean", loss="lm", k=3, keep_one=True, batch_size=2, n_boot=40, seed=5, max_rows=6)
    got = ablate(model, texts, **kw).to_json()
    name, options = seen[0]
    assert name == "heads-ablate" and options["boot"] == 40 and options["max_rows"] == 6 and options["kind"] == "mean"
    work = AblationUnits(model, texts, **{k: v for k, v in kw.items() if k != "n_boot"}, n_boot=40)
    kept: dict = {}
    for key in work.keys():  # in order: the pairs read every single effect, the CKA the pairs
        kept[key] = work.run(key, kept)
    assert list(kept) == ["single 0", "single 1", "pairs 0", "pairs 1", "cka"]  # 5 examples: batches of 2 and 3
    ref = work.finish(kept).to_json()
    got.pop("seconds"), ref.pop("seconds")
    assert got == ref and len(got["pair_heads"]) == 3


def test_the_library_settings_are_python_only_options(model, texts, capsys):
    with pytest.raises(ConfigError, match=r"^batch_size must be at least 1, got 0"):
        head_importance(model, texts, batch_size=0)
    with pytest.raises(ConfigError, match=r"^max_length must be at least 1, got 0"):
        ablate(model, texts, max_length=0)
    with pytest.raises(ConfigError, match=r"^loss 'bogus' is not a loss"):
        head_importance(model, texts, loss="bogus")
    with pytest.raises(InputError, match="takes no option seed"):  # the command line has no flag for it
        runner.run("heads-importance", {"model": model, "data": "x.txt", "seed": 1})
    with pytest.raises(ConfigError, match="not both"):
        runner.call("heads-importance", {"model": model, "data": "x.txt", "texts": texts})
    from conftest import run_cli

    code, _, err = run_cli(["heads", "ablate", "--model", "m", "--data", "x.txt", "--rel-tol", "0.1"], capsys)
    assert code == 2 and "No such option: --rel-tol" in err
    assert headlab.ablate is ablate and headlab.head_importance is head_importance
