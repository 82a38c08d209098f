"""Approximation diagnostics against brute-force computations of the same quantities."""

from __future__ import annotations

import pytest
import torch

import headlab
from headlab import masks
from headlab.attention.backends.linear import LinearBackend
from headlab.errors import ConfigError
from headlab.interpret.fidelity import approx
from headlab.interpret.fidelity.approx import compare, feature_sweep
from headlab.interpret.fidelity.model_shift import compare_model


def _qkv(B, H, Hkv, Lq, Lk, D, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64) * spread
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64) * spread
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    return q, k, v


def _window(w):
    return masks.MaskFn(lambda b, h, qi, ki, lq, lk: (qi - ki).abs() <= w, f"window({w})")


def _per_head_stride():
    # head-dependent: head h sees keys with kv_idx % (h + 2) == 0 or kv_idx == q_idx
    return masks.MaskFn(lambda b, h, qi, ki, lq, lk: ((ki % (h + 2)) == 0) | (ki == qi), "stride(h)",
                        head_dependent=True)


# name, (B, H, Hkv, Lq, Lk, D), pattern, causal
PATTERN_CASES = [
    ("window", (2, 4, 4, 37, 37, 8), _window(3), False),
    ("window-causal-gqa", (1, 6, 2, 41, 41, 8), _window(5), True),
    ("per-head-cross", (2, 3, 3, 19, 29, 4), _per_head_stride(), False),
    ("bool-tensor", (1, 2, 1, 16, 16, 8), torch.rand(16, 16, generator=torch.Generator().manual_seed(2)) < 0.4, True),
]


@pytest.mark.parametrize("case", PATTERN_CASES, ids=[c[0] for c in PATTERN_CASES])
def test_pattern_mass_outside_and_output_error(case, monkeypatch):
    name, (B, H, Hkv, Lq, Lk, D), pattern, causal = case
    monkeypatch.setattr(approx, "_CHUNK_BUDGET", B * H * Lk * 8 * 5)  # 5 query rows per chunk: many chunks
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D)
    r = compare(q, k, v, backend="sdpa", mask=pattern, causal=causal)
    # brute force: the full exact map, and the pattern materialised
    p = headlab.attention_weights(q, k, causal=causal)  # (B, H, Lq, Lk)
    vis = pattern.dense(B, H, Lq, Lk) if isinstance(pattern, masks.MaskFn) else pattern.view(1, 1, Lq, Lk)
    want_mass = (p * ~vis).sum(-1)
    assert r.mass_outside.shape == (B, H, Lq)
    assert torch.allclose(r.mass_outside.double(), want_mass, atol=1e-6)
    assert r.mass_outside_mean_per_head == pytest.approx(want_mass.mean(dim=(0, 2)).tolist(), abs=1e-6)
    out = headlab.attention(q, k, v, mask=pattern, causal=causal, backend="reference")
    exact = headlab.attention(q, k, v, causal=causal, backend="reference")
    per_head = ((out - exact).pow(2).sum((0, 2, 3)) / exact.pow(2).sum((0, 2, 3))).sqrt()
    assert r.out_rel_error == pytest.approx(float((out - exact).norm() / exact.norm()), rel=1e-6)
    assert r.out_rel_error_per_head == pytest.approx(per_head.tolist(), rel=1e-6)
    full_vis = vis & torch.ones(Lq, Lk, dtype=torch.bool).tril() if causal else vis
    assert r.empty_rows == int((~full_vis.any(-1)).expand(B, H, Lq).sum())


def test_more_mass_outside_for_narrower_window():
    q, k, v = _qkv(1, 2, 2, 48, 48, 8, spread=2.0)
    narrow = compare(q, k, v, backend="sdpa", mask=_window(1))
    wide = compare(q, k, v, backend="sdpa", mask=_window(12))
    assert narrow.mass_outside_mean > wide.mass_outside_mean > 0
    assert narrow.out_rel_error > wide.out_rel_error


def test_empty_rows_counted_and_zero():
    late = masks.MaskFn(lambda b, h, qi, ki, lq, lk: (qi >= 5) & (ki <= qi), "late")
    q, k, v = _qkv(2, 3, 3, 12, 12, 4)
    r = compare(q, k, v, backend="reference", mask=late)
    assert r.empty_rows == 2 * 3 * 5
    assert any("zeros" in n for n in r.notes)
    assert torch.allclose(r.mass_outside[:, :, :5].double(), torch.ones(2, 3, 5, dtype=torch.float64))
    out = headlab.attention(q, k, v, mask=late, backend="reference")
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))


def test_exact_backend_without_pattern_reports_zero():
    q, k, v = _qkv(1, 2, 2, 20, 20, 8)
    r = compare(q, k, v, backend="sdpa", causal=True)
    assert r.out_rel_error < 1e-12 and r.mass_outside is None and r.empty_rows == 0 and r.weights_tvd is None
    assert r.out_cosine == pytest.approx(1.0)


LINEAR_CASES = [
    ("elu", "linear", None, False),
    ("favor-causal-pad", LinearBackend("favor", num_features=64), masks.padding([30, 17]), True),
    ("relu-string", "relu", None, True),
]


@pytest.mark.parametrize("case", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
def test_linear_report_against_brute_force(case):
    _, backend, mask, causal = case
    B = 2 if mask is not None else 1
    q, k, v = _qkv(B, 4, 2, 30, 30, 8, spread=0.5)
    r = compare(q, k, v, backend=backend, mask=mask, causal=causal, sample_rows=7, seed=3)
    be = approx.resolve_backend(backend)
    rows = torch.tensor(r.sampled_rows)
    drawn = torch.randperm(30, generator=torch.Generator().manual_seed(3))[:7].sort().values
    assert len(rows) == 7 and torch.equal(rows, drawn)
    implied = be.implied_weights(q, k, rows, mask=mask, causal=causal)
    exact_w = headlab.attention_weights(q, k, mask=mask, causal=causal)[:, :, rows]  # the baseline keeps padding
    tvd = 0.5 * (implied - exact_w).abs().sum(-1)
    assert torch.allclose(r.weights_tvd.double(), tvd, atol=1e-9)
    assert r.weights_max_abs_error == pytest.approx(float((implied - exact_w).abs().max()), abs=1e-12)
    out = headlab.attention(q, k, v, mask=mask, causal=causal, backend=be)
    exact = headlab.attention(q, k, v, mask=mask, causal=causal, backend="reference")
    assert r.out_rel_error == pytest.approx(float((out - exact).norm() / exact.norm()), rel=1e-9)
    assert 0 < r.weights_tvd_mean < 1 and r.mass_outside is None
    assert r.as_dict()["weights_tvd_per_head"] is not None and "vs exact softmax" in r.summary()


def test_feature_sweep_error_falls():
    q, k, v = _qkv(1, 2, 2, 48, 48, 16, seed=5, spread=0.5)
    sw = feature_sweep(q, k, v, num_features=[8, 32, 128, 512], seeds=[0, 1, 2], sample_rows=16)
    errs = [p.out_rel_error for p in sw.points]
    tvds = [p.weights_tvd for p in sw.points]
    assert errs[0] > errs[1] > errs[2] > errs[3], errs
    assert tvds[0] > tvds[-1], tvds
    assert -1.0 < sw.slope < -0.2, sw.slope  # Monte Carlo error: about m^-1/2
    assert all(p.out_rel_error_std > 0 for p in sw.points)
    assert "slope" in sw.summary() and len(sw.as_dict()["points"]) == 4


def test_bad_arguments():
    q, k, v = _qkv(1, 2, 2, 8, 8, 4)
    with pytest.raises(ConfigError):
        compare(q, k, v, backend="linear", exact_mask="same")
    with pytest.raises(ConfigError):
        compare(q, k, v, backend="linear", sample_rows=0)
    with pytest.raises(ConfigError):
        compare(q, k, v, backend="favor:0")
    with pytest.raises(ConfigError):
        feature_sweep(q, k, v, num_features=[])
    with pytest.raises(ConfigError, match="positive"):
        feature_sweep(q, k, v, num_features=[0])


def test_compare_model_on_a_small_transformer():
    from headlab.models import adapt
    from headlab.models.loader import LoadedModel
    from headlab.models.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4)).eval()
    loaded = LoadedModel(model=m, tokenizer=None, adapter=adapt(m), name="tiny", family="headlab", max_positions=64)
    ids = torch.randint(0, 50, (2, 23), generator=torch.Generator().manual_seed(1))
    same = compare_model(loaded, {"input_ids": ids}, "reference")
    assert same.rel_error < 1e-5 and same.cosine_min > 0.99999 and same.tokens == 46
    lin = compare_model(loaded, {"input_ids": ids}, "linear")
    fav = compare_model(loaded, ids, "favor:256")
    for r in (lin, fav):
        assert 0 < r.rel_error < 1 and r.cosine_min < 1 and len(r.rel_error_per_position) == 46
    assert loaded.adapter.backend is None  # the swap is undone
    # the swap really ran the variant: the linear model equals a manual run of it
    with torch.no_grad(), loaded.adapter.use_backend("linear"):
        h = m(ids).last_hidden_state
    with torch.no_grad():
        base = m(ids).last_hidden_state
    assert lin.rel_error == pytest.approx(float((h - base).norm() / base.norm()), rel=1e-4)


def test_compare_model_padded_batch_compares_real_tokens_only():
    from headlab.models import adapt
    from headlab.models.loader import LoadedModel
    from headlab.models.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4)).eval()
    loaded = LoadedModel(model=m, tokenizer=None, adapter=adapt(m), name="tiny", family="headlab", max_positions=64)
    ids = torch.randint(1, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, 5:] = 0
    r = compare_model(loaded, {"input_ids": ids, "attention_mask": am}, "linear")
    assert r.tokens == 9 + 5
    first = compare_model(loaded, {"input_ids": ids[1:, :5]}, "linear")
    assert r.rel_error_per_position[9:] == pytest.approx(first.rel_error_per_position, rel=1e-4)  # float32 model
    am[0, 0] = 0  # left padding is refused, not silently misread
    with pytest.raises(ConfigError, match="right padding"):
        compare_model(loaded, {"input_ids": ids, "attention_mask": am}, "linear")
