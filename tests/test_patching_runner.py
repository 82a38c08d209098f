"""``headlab.patch`` runs through the study runner (``runner.call("patch", ...)``): its inputs and metric are
handed over as they are, its sweep is the instrument's one unit (the progress it is given sees the sweep's
configurations), its options are checked before any run, and the result is the sweep computed directly; the
same instrument, given ``method="both"``, adds attribution patching equal to :func:`attribution_patch`."""

from __future__ import annotations

import pytest
import torch

import headlab
from headlab.errors import ConfigError
from headlab.interpret.patching import attribution_patch, logit_diff
from headlab.interpret.patching.exact import sweep
from headlab.interpret.study import runner
from headlab.models.transformer import Transformer, TransformerConfig


def _setup():
    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1,
                                      causal=True)).eval()
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 20, (2, 6), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2] = (corrupt[:, 2] + 5) % 20
    return m, clean, corrupt, logit_diff([3, 4], [7, 8])


def test_patch_is_the_instruments_unit_through_the_runner(monkeypatch):
    m, clean, corrupt, metric = _setup()
    calls, seen = [], []
    real = runner.call
    monkeypatch.setattr(runner, "call", lambda name, options, **kw: (calls.append((name, options)), real(
        name, options, **kw))[1])
    got = headlab.patch(m, clean, corrupt, metric, sites=["z", "v"], positions=[1, 2], max_rows=4,
                        progress=lambda stage, done, total: seen.append((stage, done, total)))
    assert [name for name, _ in calls] == ["patch"] and calls[0][1]["metric"] is metric
    # one sweep over both kinds: 2 layers x (2 query heads + 1 kv head) x 2 positions
    assert seen[0] == ("patching", 0, 12) and seen[-1] == ("patching", 12, 12)
    want = sweep(m, clean, corrupt, metric, sites=["z", "v"], positions=[1, 2], max_rows=4)
    assert got.effects.keys() == want.effects.keys() == {"z", "v"}
    for kind in ("z", "v"):
        assert torch.equal(got.raw[kind], want.raw[kind]) and torch.equal(got.effects[kind], want.effects[kind])
    assert (got.clean, got.corrupted, got.positions, got.notes) == (want.clean, want.corrupted, [1, 2], want.notes)
    assert any("per kv head" in n for n in got.notes)


def test_both_methods_from_python_and_the_checks_before_any_run(monkeypatch):
    m, clean, corrupt, metric = _setup()
    run = runner.call("patch", {**dict.fromkeys(("clean", "corrupted", "answer", "wrong")), "model": m,
                                "inputs": (clean, corrupt), "metric": metric, "method": "both", "sites": ["z"]})
    exact, approx = sweep(m, clean, corrupt, metric), attribution_patch(m, clean, corrupt, metric)
    assert torch.equal(run.results["exact"].raw["z"], exact.raw["z"])
    assert torch.allclose(run.results["attribution"].effects["z"], approx.effects["z"], atol=1e-6)
    assert set(run.doc["agreement"]) == {"z"}

    from headlab.interpret.patching import runs

    monkeypatch.setattr(runs, "run_metric", lambda *a, **k: pytest.fail("a run before the options were refused"))
    with pytest.raises(ConfigError, match=r"sites='head_out'.*kinds"):
        headlab.patch(m, clean, corrupt, metric, sites="head_out")
    with pytest.raises(ConfigError, match="position 6 is not an index"):
        headlab.patch(m, clean, corrupt, metric, positions=[6])
    with pytest.raises(ConfigError, match=r"^max_rows \(rows per forward\) must be a positive integer"):
        headlab.patch(m, clean, corrupt, metric, max_rows=0)
