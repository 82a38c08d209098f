"""The ``tiled`` backend against the float64 reference (the FlashAttention error rule), its
gradients (gradcheck), masks, fully masked rows, dropout, the tiles it skips, and its cost formula."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import headlab
from headlab import costs, masks
from headlab.attention import backends
from headlab.attention.backends import tiled
from headlab.attention.backends import _threads
from headlab.attention.backends.tiled import TiledBackend, flash_attention_textbook, tiled_attention
from headlab.attention.backends.tiled import forward as tiled_forward
from headlab.attention.backends.tiled.plan import make_plan
from headlab.spec.attention_spec import validate
from headlab.errors import ConfigError
from headlab.testing import compare_backend
from cases import BY_NAME, make_inputs


# Tile shapes that break the shared cases (tests/cases.py) in every way: tiles smaller than the
# sequence, not dividing it, taller than wide and the reverse; the core test runs the default tile.
TILINGS = [
    ("odd_cross", (32, 64)), ("longer_q", (32, 32)), ("causal_rect", (8, 16)), ("gqa4_causal", (16, 32)),
    ("gqa8_mqa", (32, 32)), ("random_mask", (16, 16)), ("fully_masked_rows", (8, 8)), ("key_padding", (4, 8)),
    ("mask_fn", (16, 8)), ("mask_fn_lower_right", (4, 8)), ("plain_fn_causal", (16, 16)),
    ("window_113x203_gqa", (32, 64)), ("bigbird_gqa", (64, 128)), ("documents_causal", (64, 32)),
    ("additive_float_mask", (16, 16)), ("scale_16_window", (64, 64)), ("few_keys_many_rows", (64, 2)),
    ("lq1_bigbird", (1, 64)), ("float16", (16, 32)), ("bfloat16", (32, 16)), ("float64", (16, 16)),
    ("causal_1023x1024", (256, 512)), ("dense_1023x1024", (128, 256)), ("d111_512x256", (64, 96)),
]


@pytest.mark.parametrize("name,blocks", TILINGS, ids=[f"{n} {b[0]}x{b[1]}" for n, b in TILINGS])
def test_flash_error_rule_small_tiles(name, blocks):
    case = BY_NAME[name]
    q, k, v, mask = make_inputs(case)
    report = compare_backend(TiledBackend(*blocks), q, k, v, mask=mask, causal=case.causal, scale=case.scale)
    assert report.ok, report.failures()


def test_textbook_flash_attention_is_the_fast_path():
    """The 30-line textbook FlashAttention (docs/tiled.md) computes what the fast forward computes."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 113, 24, generator=g, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        out, lse = flash_attention_textbook(q, k, v, causal=causal, block_q=16, block_k=32)
        fast, fast_lse = tiled_attention(q, k, v, causal=causal, block_q=16, block_k=32, return_lse=True)
        torch.testing.assert_close(out, fast, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse, fast_lse, rtol=0, atol=1e-12)
        torch.testing.assert_close(out, headlab.attention(q, k, v, causal=causal, backend="reference"),
                                   rtol=0, atol=1e-12)


def test_fully_masked_rows_zero_output_zero_grads():
    q, k, v = (torch.randn(2, 2, 40, 16, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 1, 40, 40, dtype=torch.bool)
    mask[0, :, 5] = False
    mask[1, :, 30:] = False
    out = tiled_attention(q, k, v, mask=mask, block_q=16, block_k=16)
    assert torch.isfinite(out).all()
    assert out[0, :, 5].abs().max() == 0 and out[1, :, 30:].abs().max() == 0
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert q.grad[0, :, 5].abs().max() == 0 and q.grad[1, :, 30:].abs().max() == 0
    _, lse = tiled_attention(q, k, v, mask=mask, block_q=16, block_k=16, return_lse=True)
    assert torch.isneginf(lse[0, :, 5]).all()


def test_lse_matches_reference():
    q, k = torch.randn(1, 3, 70, 24, dtype=torch.float64), torch.randn(1, 3, 90, 24, dtype=torch.float64)
    _, lse = tiled_attention(q, k, k, causal=True, block_q=16, block_k=32, return_lse=True)
    s = (q @ k.transpose(-1, -2)) / 24 ** 0.5
    s = s.masked_fill(~torch.ones(70, 90, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=0, atol=1e-12)


def test_stale_max_overflow_falls_back_to_exact():
    # later keys give logits ~1000 above the first tile's: exp would overflow without the fallback
    q = torch.randn(1, 2, 64, 16, dtype=torch.float32)
    k = torch.randn(1, 2, 96, 16)
    k[:, :, 50:] *= 60
    v = torch.randn(1, 2, 96, 16)
    out = tiled_attention(q, k, v, block_q=32, block_k=32)
    ref = headlab.attention(q.double(), k.double(), v.double(), backend="reference")
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < 1e-4


GRADCHECK = [
    ("plain", dict(), (1, 2, 2, 7, 9, 3)),
    ("causal GQA", dict(causal=True), (1, 4, 2, 9, 7, 3)),
    ("mask with dead row", dict(mask="dead"), (2, 2, 2, 6, 8, 4)),
    ("dropout seeded", dict(dropout_p=0.3, seed=7), (1, 2, 1, 6, 7, 3)),
]


@pytest.mark.parametrize("name,opts,shape", GRADCHECK, ids=[g[0] for g in GRADCHECK])
def test_gradcheck_float64(name, opts, shape):
    B, H, Hkv, Lq, Lk, D = shape
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, D + 1, generator=g, dtype=torch.float64, requires_grad=True)
    opts = dict(opts)
    if opts.get("mask") == "dead":
        m = torch.rand(B, 1, Lq, Lk, generator=g) > 0.4
        m[:, :, 2] = False
        opts["mask"] = m
    assert torch.autograd.gradcheck(lambda a, b, c: tiled_attention(a, b, c, block_q=4, block_k=3, **opts), (q, k, v))


def test_dropout_is_the_reference_with_the_regenerated_mask():
    B, H, L, D, p = 1, 2, 40, 8, 0.25
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64) for _ in range(3))
    out = tiled_attention(q, k, v, causal=True, dropout_p=p, seed=11, block_q=16, block_k=16)
    assert torch.equal(out, tiled_attention(q, k, v, causal=True, dropout_p=p, seed=11, block_q=16, block_k=16))
    assert not torch.equal(out, tiled_attention(q, k, v, causal=True, dropout_p=p, seed=12, block_q=16, block_k=16))
    spec, m = validate(q, k, v, causal=True, dropout_p=p)
    plan = make_plan(spec, m, D ** -0.5, p, 11, 16, 16)
    keep = torch.ones(B * H, L, L, dtype=torch.bool)  # rows of the (B*Hkv, Lq*G, Lk) layout, G = 1
    for qb in range(plan.n_qb):
        i0, i1 = plan.q_rows(qb)
        for kb in range(len(plan.states[0])):
            j0, j1 = plan.k_cols(kb)
            keep[:, i0:i1, j0:j1] = plan.keep(qb, kb, (B * H, i1 - i0, j1 - j0), q.device)
    w = headlab.attention_weights(q, k, causal=True)
    ref = (w * keep.view(B, H, L, L) / (1 - p)) @ v
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert 0.6 < keep.float().mean() < 0.9


def test_registered_and_auto_keeps_sdpa():
    assert "tiled" in backends.names()
    q = torch.randn(1, 2, 8, 4)
    spec, _ = validate(q, q, q, causal=True)
    assert backends.choose(spec).name == "sdpa"
    assert backends.get("tiled").priority > backends.get("sdpa").priority
    out = headlab.attention(q, q, q, causal=True, backend="tiled")
    torch.testing.assert_close(out, headlab.attention(q, q, q, causal=True, backend="reference"))


def test_bad_blocks():
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(ConfigError, match="block_q"):
        tiled_attention(q, q, q, block_q=0)
    with pytest.raises(ConfigError):
        TiledBackend(16, -1)


def test_tile_states_from_bool_mask_and_mask_fn_agree():
    Lq, Lk = 70, 90
    mf = masks.causal() & masks.padding([50])
    q = torch.zeros(1, 2, Lq, 8)
    k = torch.zeros(1, 2, Lk, 8)
    spec_fn, m_fn = validate(q, k, k, mask=mf)
    spec_b, m_b = validate(q, k, k, mask=mf.dense(1, 2, Lq, Lk))
    a = tiled.tile_states(spec_fn, m_fn, 16, 16)
    b = tiled.tile_states(spec_b, m_b, 16, 16)
    assert torch.equal(a, b)
    assert int((a == 0).sum()) > 0 and int((a == 2).sum()) > 0


FLOP_CASES = [
    ("dense", dict(), None),
    ("causal", dict(causal=True), None),
    ("padding: empty key tiles", dict(), masks.padding([100])),
    ("GQA causal 113x203", dict(causal=True, heads=4, kv_heads=2, q_len=113, kv_len=203, head_dim=40), None),
]


def _baddbmm_flops(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    b, m, k = a_shape
    return 2 * b * m * b_shape[2] * k


@pytest.mark.parametrize("name,opts,mask", FLOP_CASES, ids=[f[0] for f in FLOP_CASES])
def test_cost_formula_counts_the_matmuls_the_kernel_runs(name, opts, mask):
    o = dict(heads=2, q_len=300, head_dim=32) | opts
    shape = costs.AttentionShape(batch=1, causal=o.pop("causal", False), mask=mask, **o)
    bq, bk = 64, 128
    q = torch.randn(1, shape.heads, shape.q_len, shape.head_dim, requires_grad=True)
    k = torch.randn(1, shape.kv_heads, shape.kv_len, shape.head_dim, requires_grad=True)
    v = torch.randn(1, shape.kv_heads, shape.kv_len, shape.head_dim, requires_grad=True)
    # FlopCounterMode knows baddbmm but not its in-place form, which the kernel accumulates with
    inplace = {torch.ops.aten.baddbmm_: _baddbmm_flops}
    with FlopCounterMode(display=False, custom_mapping=inplace) as fwd_counter:
        out = tiled_attention(q, k, v, causal=shape.causal, mask=mask, block_q=bq, block_k=bk)
    with FlopCounterMode(display=False, custom_mapping=inplace) as bwd_counter:
        out.sum().backward()
    pred_fwd, pred_bwd = costs.tiled.tiled_flops(shape, bq, bk)
    assert fwd_counter.get_total_flops() == pred_fwd
    assert bwd_counter.get_total_flops() == pred_bwd
    full = 2 * shape.heads * shape.q_len * shape.kv_len * (2 * shape.head_dim + 2)
    if shape.causal or mask is not None:
        assert pred_fwd < full  # skipped tiles are not counted (nor computed)


def test_cost_registered_and_linear_working_set():
    small = costs.estimate(costs.AttentionShape(heads=8, q_len=4096, head_dim=64), "tiled")
    big = costs.estimate(costs.AttentionShape(heads=8, q_len=16384, head_dim=64), "tiled")
    assert small.attention_weights_bytes == big.attention_weights_bytes == 0
    assert big.working_set_bytes < 4.5 * small.working_set_bytes  # linear, not quadratic
    assert 2.3 < big.backward_flops / big.forward_flops < 2.6


@pytest.mark.slow
def test_memory_at_16k_tokens_in_a_fresh_process():
    """Forward + backward at 16,384 tokens (B=1, H=8, d=64, fp32) under 5% of the 8 GiB map."""
    from headlab.attention.measure import _mem_run, _mem_setup, peak_memory_growth

    cfg = {"seq_len": 16384, "batch": 1, "heads": 8, "head_dim": 64, "dtype": torch.float32,
           "causal": False, "backward": True, "mask": None, "seed": 0}
    grew = peak_memory_growth(_mem_run, cfg, "tiled", setup=_mem_setup)
    assert grew < 0.05 * 8 * 2**30, grew


# Work units of the threaded forward: one head per unit (UNIT_ELEMS=1), so every mask path that
# slices the flattened (batch, kv head) axis runs; per-head masks, window functions, causal, GQA.
UNIT_CASES = [("fully_masked_rows", (8, 16)), ("plain_fn_causal", (16, 16)), ("window_113x203_gqa", (32, 64)),
              ("causal_1023x1024", (128, 256)), ("additive_float_mask", (16, 16))]


@pytest.mark.parametrize("name,blocks", UNIT_CASES, ids=[n for n, _ in UNIT_CASES])
def test_threaded_head_units_match_serial_and_reference(name, blocks, monkeypatch):
    case = BY_NAME[name]
    q, k, v, mask = make_inputs(case)
    monkeypatch.setattr(tiled_forward, "UNIT_ELEMS", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        report = compare_backend(TiledBackend(*blocks), q, k, v, mask=mask, causal=case.causal)
        assert report.ok, report.failures()
        assert torch.get_num_threads() == 2  # restored after the pool
        out = tiled_attention(q, k, v, mask=mask, causal=case.causal, block_q=blocks[0], block_k=blocks[1])
        monkeypatch.setattr(_threads, "THREADED", False)
        serial = tiled_attention(q, k, v, mask=mask, causal=case.causal, block_q=blocks[0], block_k=blocks[1])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, serial, rtol=0, atol=1e-6)


def test_threaded_forward_under_inference_mode_and_no_grad():
    q, k, v = (torch.randn(1, 4, 300, 32) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            a = tiled_attention(q, k, v, causal=True, block_q=64, block_k=64)
        with torch.no_grad():
            b = tiled_attention(q, k, v, causal=True, block_q=64, block_k=64)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(a, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(b, ref, rtol=0, atol=1e-5)
