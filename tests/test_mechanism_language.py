"""torch's and FlexAttention's language on every exact backend: return_lse, additive float masks,
score_mod (alibi, softcap, relative_bias), and the non-finite input policy. Each checked under
the FlashAttention rule or against a direct computation of its definition."""

from __future__ import annotations

import math

import pytest
import torch

import headlab
from headlab import masks
from headlab.errors import BackendUnsupportedError, ConfigError
from headlab.testing import compare_backend

EXACT = ["reference", "sdpa", "tiled", "sparse"]


def _qkv(b=2, h=4, hkv=2, lq=37, lk=53, d=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, d, generator=g, dtype=dtype), torch.randn(b, hkv, lk, d, generator=g, dtype=dtype),
            torch.randn(b, hkv, lk, d, generator=g, dtype=dtype))


def _lse_direct(q, k, vis, scale):
    """log sum_j exp(s_ij) over the visible keys, from the float64 scores; -inf when none."""
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~vis, float("-inf"))
    return torch.logsumexp(s, -1)


@pytest.mark.parametrize("backend", EXACT)
def test_return_lse_is_the_log_sum_exp(backend):
    q, k, v = _qkv()
    mask = masks.causal() & masks.padding([53, 0])  # batch 1 sees nothing: lse -inf
    out, lse = headlab.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
    vis = mask.dense(2, 4, 37, 53, expand=True)
    want = _lse_direct(q, k, vis, 16 ** -0.5)
    assert lse.shape == (2, 4, 37) and lse.dtype == torch.float64
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want))
    torch.testing.assert_close(lse.masked_fill(torch.isinf(lse), 0), want.masked_fill(torch.isinf(want), 0),
                               rtol=0, atol=1e-10)
    torch.testing.assert_close(out, headlab.attention(q, k, v, mask=mask, backend="reference"), rtol=0, atol=1e-10)


def test_return_lse_float32_and_refusals():
    q, k, v = _qkv(dtype=torch.float32)
    for be in ("reference", "sdpa", "tiled"):
        _, lse = headlab.attention(q, k, v, causal=True, backend=be, return_lse=True)
        assert lse.dtype == torch.float32 and not lse.requires_grad
    with pytest.raises(BackendUnsupportedError, match="log-sum-exp"):
        headlab.attention(q, k, v, backend="linear", return_lse=True)
    out, lse = headlab.attention(q.half(), k.half(), v.half(), return_lse=True)  # auto, half inputs
    assert out.dtype == torch.float16 and lse.dtype == torch.float32


ADDITIVE_SHAPES = [(37, 53), (2, 1, 37, 53), (2, 1, 1, 53), (1, 4, 37, 1)]


@pytest.mark.parametrize("shape", ADDITIVE_SHAPES, ids=str)
@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_additive_float_mask_is_torch_sdpa_float_mask(shape, backend):
    q, k, v = _qkv(dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(shape, generator=g)
    bias[torch.rand(shape, generator=g) > 0.8] = float("-inf")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    dead = torch.isneginf(bias.expand(2, 4, 37, 53)).all(-1, keepdim=True)
    want = want.masked_fill(dead, 0.0)
    got = headlab.attention(q, k, v, mask=bias, backend=backend)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    rep = compare_backend(backend, q, k, v, mask=bias)
    assert rep.ok, rep.failures()


def test_additive_mask_with_causal_and_sparse_refusal():
    q, k, v = _qkv(lq=40, lk=40, dtype=torch.float32)
    bias = torch.randn(40, 40)
    tri = torch.ones(40, 40, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~tri, float("-inf")),
                                                            enable_gqa=True)
    for be in ("reference", "sdpa", "tiled"):
        torch.testing.assert_close(headlab.attention(q, k, v, mask=bias, causal=True, backend=be), want,
                                   atol=2e-6, rtol=1e-5)
    with pytest.raises(BackendUnsupportedError, match="additive float"):
        headlab.attention(q, k, v, mask=bias, causal=True, backend="sparse")


SCORE_MODS = [
    ("alibi", lambda: masks.alibi(masks.alibi_slopes(4)),
     lambda s, i, j, h: s + masks.alibi_slopes(4).view(1, 4, 1, 1) * (j - i).double()),
    ("softcap", lambda: masks.softcap(2.0), lambda s, i, j, h: 2.0 * torch.tanh(s / 2.0)),
    ("relative_bias", lambda: masks.relative_bias(torch.linspace(-1, 1, 4 * 9, dtype=torch.float64).view(4, 9)),
     lambda s, i, j, h: s + torch.linspace(-1, 1, 36, dtype=torch.float64).view(4, 9)[
         torch.arange(4).view(1, 4, 1, 1), ((j - i).clamp(-4, 4) + 4)]),
    ("plain function", lambda: (lambda s, b, h, q, kv: s * (1.0 + 0.1 * h) - 0.01 * (q - kv).abs()),
     lambda s, i, j, h: s * (1.0 + 0.1 * h) - 0.01 * (i - j).abs()),
]


def _direct(q, k, v, vis, scale, formula):
    """softmax(formula(q k^T * scale)) v over the visible keys, written from the definition."""
    kk, vv = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    s = (q @ kk.transpose(-1, -2)) * scale
    Lq, Lk = s.shape[-2:]
    i = torch.arange(Lq).view(1, 1, Lq, 1)  # integer positions, as a score_mod receives them
    j = torch.arange(Lk).view(1, 1, 1, Lk)
    s = formula(s, i, j, torch.arange(s.shape[1]).view(1, -1, 1, 1))
    s = s.masked_fill(~vis, float("-inf"))
    dead = torch.isneginf(s).all(-1, keepdim=True)
    return (torch.softmax(s.masked_fill(dead, 0.0), -1) @ vv).masked_fill(dead, 0.0)


@pytest.mark.parametrize("backend", ["reference", "tiled", "sparse"])
@pytest.mark.parametrize("name,make,formula", SCORE_MODS, ids=[s[0] for s in SCORE_MODS])
def test_score_mod_forward_and_backward(name, make, formula, backend):
    q, k, v = _qkv(lq=150, lk=150)
    mask = masks.sliding_window(40) | masks.global_tokens([0])
    mod = make()
    vis = mask.dense(2, 4, 150, 150, expand=True) & torch.ones(150, 150, dtype=torch.bool).tril()
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = headlab.attention(qq, kk, vv, mask=mask, causal=True, score_mod=mod, backend=backend)
    ref = _direct(q, k, v, vis, 0.25, formula)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (qq, kk, vv), g)
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(_direct(q2, k2, v2, vis, 0.25, formula), (q2, k2, v2), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


@pytest.mark.parametrize("backend", ["reference", "tiled", "sparse"])
def test_score_mod_holds_the_flash_rule_in_float32(backend):
    q, k, v = _qkv(b=1, h=4, hkv=2, lq=200, lk=200, d=32, dtype=torch.float32)
    for mod in (masks.softcap(5.0), masks.alibi(masks.alibi_slopes(4))):
        rep = compare_backend(backend, q, k, v, mask=masks.sliding_window(64), causal=True, scale=1.0, score_mod=mod)
        assert rep.ok, (mod, rep.failures())


def test_score_mod_refused_where_not_served_and_declared():
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(BackendUnsupportedError, match="score_mod"):
        headlab.attention(q, k, v, score_mod=masks.softcap(3.0), backend="sdpa")
    out = headlab.attention(q, k, v, score_mod=masks.softcap(3.0))  # auto picks a backend that serves it
    torch.testing.assert_close(out, headlab.attention(q, k, v, score_mod=masks.softcap(3.0), backend="reference"),
                               atol=2e-6, rtol=1e-5)
    rows = {r["name"]: r for r in headlab.backends()}
    assert [n for n, r in rows.items() if r["score_mod"]] == ["tiled", "sparse", "reference"]
    assert all(rows[n]["returns_lse"] for n in EXACT) and not rows["linear"]["returns_lse"]
    assert all(rows[n]["additive_mask"] for n in ("reference", "sdpa", "tiled"))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="softcap"):
            masks.softcap(bad)


def test_softcap_keeps_scores_inside_the_cap():
    q, k, _ = _qkv(lq=5, lk=5)
    w = headlab.attention_weights(q * 50, k, score_mod=masks.softcap(1.0))
    # capped logits lie in (-1, 1): no weight is more than e^2 times another in its row
    assert float((w.amax(-1) / w.amin(-1)).max()) < math.exp(2.0) + 1e-6


NONFINITE = ["reference", "sdpa", "tiled", "sparse", "linear"]


@pytest.mark.parametrize("backend", NONFINITE)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_input_propagates_and_dead_rows_stay_zero(backend, bad):
    q, k, v = _qkv(b=1, h=2, hkv=2, lq=40, lk=40, dtype=torch.float32)
    q[0, 0, 7, 3] = bad
    mask = masks.causal() & masks.padding([40])
    out = headlab.attention(q, k, v, mask=mask if backend != "linear" else None, causal=backend == "linear",
                            backend=backend)
    assert not torch.isfinite(out[0, 0, 7]).any()  # the row that read the NaN / inf is not a plausible answer
    others = torch.ones(40, dtype=torch.bool)
    others[7] = False
    assert torch.isfinite(out[0, 0, others]).all() and torch.isfinite(out[0, 1]).all()
    if backend != "linear":  # a row that sees no key is zeros, also next to a NaN
        m = torch.ones(1, 1, 40, 40, dtype=torch.bool)
        m[..., 5, :] = False
        qq = q.clone()
        qq[0, 0, 5] = float("nan")
        be_mask = masks.block_layout(torch.ones(2, 2, dtype=torch.bool), 20) & masks.as_mask(
            lambda b, h, i, j: i != 5) if backend == "sparse" else m
        o = headlab.attention(qq, k, v, mask=be_mask, backend=backend)
        assert (o[0, :, 5] == 0).all()


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled", "sparse", "auto"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("mask_kind", ["causal", "window", "bool", "additive", "none"])
def test_a_bad_key_or_value_reaches_exactly_the_rows_that_read_it(backend, where, mask_kind):
    """One rule on every exact backend: a NaN in key/value row j makes exactly the query rows that
    can see j NaN (through GQA: every query head of that kv head); every other row equals the
    computation on clean inputs (no 0 * NaN for a hidden key, no -inf + NaN)."""
    B, H, Hkv, L = 2, 4, 2, 23
    q, k, v = _qkv(b=B, h=H, hkv=Hkv, lq=L, lk=L, dtype=torch.float32)
    tril = torch.ones(L, L, dtype=torch.bool).tril()
    kw, vis = {
        "causal": ({"causal": True}, tril),
        "window": ({"mask": masks.sliding_window(3)}, masks.sliding_window(3).dense(1, 1, L, L)[0, 0]),
        "bool": ({"mask": tril}, tril),
        "additive": ({"mask": torch.zeros(L, L).masked_fill(~tril, float("-inf"))}, tril),
        "none": ({}, torch.ones(L, L, dtype=torch.bool)),
    }[mask_kind]
    if backend == "sparse" and mask_kind == "additive":
        pytest.skip("sparse takes no additive float mask (its own refusal)")
    clean = headlab.attention(q, k, v, backend=backend, **kw)
    j = 11
    bad = {"k": k, "v": v}[where].clone()
    bad[1, 0, j, 2] = float("nan")
    args = (q, bad, v) if where == "k" else (q, k, bad)
    out = headlab.attention(*args, backend=backend, **kw)
    reads = torch.zeros(B, H, L, dtype=torch.bool)
    reads[1, :H // Hkv] = vis[:, j]  # kv head 0 serves query heads 0 and 1
    assert torch.equal(torch.isnan(out).any(-1), reads)
    torch.testing.assert_close(out[~reads], clean[~reads], atol=1e-6, rtol=1e-5)
    if where == "k" and backend in ("reference", "auto"):
        w = headlab.attention_weights(*args[:2], **kw)
        assert torch.equal(torch.isnan(w).any(-1), reads)


def test_nan_in_q_is_not_zeros_on_auto():
    q, k, v = _qkv(b=1, h=2, hkv=2, lq=16, lk=16, dtype=torch.float32)
    q[0, 1, 3, 0] = float("nan")
    out = headlab.attention(q, k, v)
    assert torch.isnan(out[0, 1, 3]).all() and torch.isfinite(out[0, 0]).all()


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale_is_a_config_error(scale):
    q, k, v = _qkv(dtype=torch.float32)
    for be in NONFINITE:
        with pytest.raises(ConfigError, match="finite"):
            headlab.attention(q, k, v, causal=True, scale=scale, backend=be)


def test_sdpa_half_gqa_grads_accumulate_the_group_in_float32():
    """6 query heads on 1 kv head in float16: torch sums dk / dv over the group in half precision."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 6, 128, 64, generator=g).half()
    k, v = (torch.randn(1, 1, 128, 64, generator=g).half() for _ in range(2))
    rep = compare_backend("sdpa", q, k, v, causal=True)
    assert rep.ok, rep.failures()
    ratio = rep.ratios()
    assert ratio["dk"] < 2.0 and ratio["dv"] < 2.0, ratio  # 2.3x and 3.2x when torch reduced the group


@pytest.mark.parametrize("backend", ["tiled", "sparse"])
def test_score_mod_tables_get_their_gradients(backend):
    """A learned relative-bias table and ALiBi slopes given as tensors get the reference's gradients
    (with q, k, v) on the tiled and sparse kernels, which add up each tile's vector-Jacobian product."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 130, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 130, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    table = torch.randn(4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(4, generator=g, dtype=torch.float64, requires_grad=True)
    for sm, t in ((masks.relative_bias(table), table), (masks.alibi(slopes), slopes)):
        got, ref = ([torch.autograd.grad((o * o).sum(), (q, k, v, t)) for o in
                     [headlab.attention(q, k, v, mask=masks.sliding_window(20), causal=True, score_mod=sm, backend=b)]][0]
                    for b in (backend, "reference"))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
        assert float(got[3].abs().sum()) > 0
