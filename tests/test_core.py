"""The functional core: parity of every dense backend with the float64 reference and with torch SDPA.

One named case table; each case is run on each backend under the FlashAttention error rule
(REFERENCES.md section 2) for outputs and gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import headlab
from headlab import masks
from headlab.errors import (
    BackendUnsupportedError,
    DeviceError,
    DTypeError,
    HeadlabError,
    MaskError,
    ShapeError,
    UnknownBackendError,
)
from headlab.testing import compare_backend


@dataclass(frozen=True)
class Case:
    name: str
    batch: int = 2
    heads: int = 4
    kv_heads: int = 4
    q_len: int = 17
    kv_len: int = 17
    head_dim: int = 16
    v_dim: int | None = None
    dtype: torch.dtype = torch.float32
    causal: bool = False
    mask: str | None = None  # "random", "dead_rows", "key_padding", "fn", "fn_lower_right"
    noncontiguous: bool = False


CASES = [
    Case("odd_self"),
    Case("odd_cross", q_len=113, kv_len=203, head_dim=40),
    Case("longer_q", q_len=203, kv_len=113, head_dim=59, causal=True),
    Case("causal_square", q_len=65, kv_len=65, causal=True),
    Case("causal_rect", q_len=31, kv_len=47, causal=True),
    Case("gqa2", heads=8, kv_heads=4, q_len=33, kv_len=40),
    Case("gqa4_causal", heads=8, kv_heads=2, q_len=33, kv_len=33, causal=True),
    Case("gqa8_mqa", heads=8, kv_heads=1, q_len=29, kv_len=51),
    Case("v_dim_differs", head_dim=24, v_dim=40, q_len=20, kv_len=30),
    Case("random_mask", mask="random", q_len=37, kv_len=45),
    Case("fully_masked_rows", mask="dead_rows", q_len=23, kv_len=31),
    Case("key_padding", mask="key_padding", q_len=19, kv_len=19),
    Case("mask_fn", mask="fn", q_len=40, kv_len=40),
    Case("mask_fn_lower_right", mask="fn_lower_right", q_len=12, kv_len=30, heads=4, kv_heads=2),
    Case("noncontiguous", noncontiguous=True, q_len=21, kv_len=26, heads=4, kv_heads=2),
    Case("float64", dtype=torch.float64, q_len=50, kv_len=60, causal=True),
    Case("bfloat16", dtype=torch.bfloat16, q_len=64, kv_len=80),
    Case("bfloat16_masked", dtype=torch.bfloat16, q_len=33, kv_len=33, mask="dead_rows"),
    Case("float16", dtype=torch.float16, q_len=48, kv_len=48, causal=True),
]


def make_inputs(c: Case, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vd = c.v_dim or c.head_dim
    if c.noncontiguous:  # (B, T, H, D) storage viewed as (B, H, T, D)
        q = torch.randn(c.batch, c.q_len, c.heads, c.head_dim, generator=g).transpose(1, 2)
        k = torch.randn(c.batch, c.kv_len, c.kv_heads, c.head_dim, generator=g).transpose(1, 2)
        v = torch.randn(c.batch, c.kv_len, c.kv_heads, vd, generator=g).transpose(1, 2)
        assert not q.is_contiguous()
    else:
        q = torch.randn(c.batch, c.heads, c.q_len, c.head_dim, generator=g)
        k = torch.randn(c.batch, c.kv_heads, c.kv_len, c.head_dim, generator=g)
        v = torch.randn(c.batch, c.kv_heads, c.kv_len, vd, generator=g)
    q, k, v = (t.to(c.dtype) for t in (q, k, v))
    mask = None
    if c.mask == "random":
        mask = torch.rand(c.batch, 1, c.q_len, c.kv_len, generator=g) > 0.4
    elif c.mask == "dead_rows":
        mask = torch.rand(c.batch, c.heads, c.q_len, c.kv_len, generator=g) > 0.5
        mask[:, :, 3] = False  # query 3 sees nothing in every head
        mask[0, 1, 7] = False
    elif c.mask == "key_padding":
        lengths = torch.tensor([c.kv_len, c.kv_len - 5])[: c.batch]
        mask = (torch.arange(c.kv_len)[None, :] < lengths[:, None]).view(c.batch, 1, 1, c.kv_len)
    elif c.mask == "fn":
        mask = masks.causal() & masks.padding([c.kv_len - 3, c.kv_len - 11][: c.batch])
    elif c.mask == "fn_lower_right":
        mask = masks.causal_lower_right()
    return q, k, v, mask


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_backend_matches_float64_reference(case, backend):
    q, k, v, mask = make_inputs(case)
    report = compare_backend(backend, q, k, v, mask=mask, causal=case.causal)
    assert report.ok, report.failures()


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == torch.float32], ids=lambda c: c.name)
def test_equals_torch_sdpa(case):
    """headlab.attention == torch's scaled_dot_product_attention with the same semantics."""
    q, k, v, mask = make_inputs(case)
    attn_mask = mask.dense(case.batch, case.heads, case.q_len, case.kv_len) if isinstance(mask, masks.MaskFn) else mask
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=case.causal,
                                              enable_gqa=case.heads != case.kv_heads)
    if attn_mask is not None:  # torch leaves fully masked rows at 0 on its flash path; headlab guarantees it
        expected = expected.masked_fill(~attn_mask.any(-1, keepdim=True), 0.0)
    for backend in ("auto", "sdpa", "reference"):
        out = headlab.attention(q, k, v, mask=mask, causal=case.causal, backend=backend)
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    c = Case("dead", mask="dead_rows", q_len=11, kv_len=13)
    q, k, v, mask = make_inputs(c)
    for backend in ("sdpa", "reference"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = headlab.attention(qq, kk, vv, mask=mask, backend=backend)
        assert torch.isfinite(out).all()
        assert (out[:, :, 3] == 0).all() and (out[0, 1, 7] == 0).all()
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (qq, kk, vv))
        assert (qq.grad[:, :, 3] == 0).all()
    w = headlab.attention_weights(q, k, mask=mask)
    assert (w[:, :, 3] == 0).all() and torch.isfinite(w).all()


def test_causal_means_torch_is_causal_top_left():
    q = torch.randn(1, 1, 2, 8)
    k = torch.randn(1, 1, 4, 8)
    w = headlab.attention_weights(q, k, causal=True)[0, 0]
    assert (w > 0).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0]]
    w = headlab.attention_weights(q, k, mask=masks.causal_lower_right())[0, 0]
    assert (w > 0).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def test_attention_weights_match_torch_mha_weights_definition():
    c = Case("w", heads=8, kv_heads=2, q_len=9, kv_len=14)
    q, k, v, _ = make_inputs(c)
    w = headlab.attention_weights(q, k, scale=0.3)
    kr = k.repeat_interleave(4, dim=1)
    torch.testing.assert_close(w, torch.softmax(q @ kr.transpose(-1, -2) * 0.3, -1))
    torch.testing.assert_close(headlab.attention(q, k, v, scale=0.3, backend="reference"),
                               w @ v.repeat_interleave(4, dim=1))


def test_mask_composition_and_plain_functions():
    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 2

    m = masks.causal() & band
    dense = m.dense(1, 1, 6, 6)[0, 0]
    expected = torch.tensor([[abs(i - j) <= 2 and i >= j for j in range(6)] for i in range(6)])
    assert torch.equal(dense, expected)
    assert torch.equal((~masks.causal()).dense(1, 1, 3, 3)[0, 0], torch.ones(3, 3, dtype=torch.bool).triu(1))
    assert torch.equal((masks.causal() | ~masks.causal()).dense(1, 1, 4, 4)[0, 0], torch.ones(4, 4, dtype=torch.bool))
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    out_fn = headlab.attention(q, k, v, mask=m)
    out_t = headlab.attention(q, k, v, mask=expected)
    torch.testing.assert_close(out_fn, out_t)


def test_block_map_agrees_with_dense_evaluation():
    for m in (masks.causal(), masks.causal_lower_right(), ~masks.causal(), masks.causal() & masks.causal_lower_right()):
        for lq, lk, bq, bk in ((37, 53, 8, 16), (64, 64, 16, 16), (10, 100, 4, 32)):
            hinted = m.block_map(lq, lk, bq, bk).state
            from headlab.attention.blocks import _classify_dense
            dense = _classify_dense(m, lq, lk, bq, bk, 1, 1, torch.device("cpu"))
            assert torch.equal(hinted, dense), (m, lq, lk)


def test_auto_choice_and_explicit_refusal():
    q = k = v = torch.randn(1, 2, 8, 4)
    from headlab.attention import backends
    from headlab.attention.spec import validate

    spec, _ = validate(q, k, v)
    assert backends.choose(spec).name == "sdpa"
    spec_w, _ = validate(q, k, v, need_weights=True)
    assert backends.choose(spec_w).name == "reference"
    with pytest.raises(BackendUnsupportedError, match=r"backend 'sdpa'.*weights.*use backend='reference'"):
        backends.require(backends.get("sdpa"), spec_w)
    with pytest.raises(UnknownBackendError, match=r"unknown backend 'flashy'.*known backends: auto, "):
        headlab.attention(q, k, v, backend="flashy")


def test_auto_passes_over_a_backend_that_would_not_fit(monkeypatch):
    """sdpa must materialise a mask function as an n x n boolean mask; when that does not fit,
    auto takes the next exact backend that skips empty tiles instead."""
    q = k = v = torch.randn(1, 2, 2048, 8)
    mask = masks.causal() & masks.padding([1500])
    monkeypatch.setenv("HEADLAB_MEMORY_LIMIT", str(3 << 20))  # 3 MiB: the 4 MiB boolean mask does not fit
    from headlab.attention import backends
    from headlab.attention.spec import validate

    spec, _ = validate(q, k, v, mask=mask)
    chosen = backends.choose(spec)
    assert chosen.name != "sdpa" and chosen.capabilities.exact and not chosen.capabilities.materializes
    out = headlab.attention(q, k, v, mask=mask)
    monkeypatch.delenv("HEADLAB_MEMORY_LIMIT")
    torch.testing.assert_close(out, headlab.attention(q, k, v, mask=mask, backend="sdpa"), atol=2e-6, rtol=1e-5)


BAD_INPUTS = [
    ("head_dim_mismatch", lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 6), torch.randn(1, 2, 4, 6)), {},
     ShapeError, "same head_dim"),
    ("heads_not_multiple", lambda: (torch.randn(1, 6, 4, 8), torch.randn(1, 4, 4, 8), torch.randn(1, 4, 4, 8)), {},
     ShapeError, "multiple of kv heads"),
    ("three_dims", lambda: (torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8)), {},
     ShapeError, "must have 4 dims"),
    ("mask_not_broadcast", lambda: (torch.randn(1, 2, 4, 8),) * 3, {"mask": torch.ones(3, 5, dtype=torch.bool)},
     MaskError, "does not broadcast"),
    ("float_mask", lambda: (torch.randn(1, 2, 4, 8),) * 3, {"mask": torch.zeros(4, 4)}, MaskError, "boolean"),
    ("int_dtype", lambda: (torch.ones(1, 2, 4, 8, dtype=torch.long),) * 3, {}, DTypeError, "floating dtype"),
    ("mixed_dtypes", lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8).double(), torch.randn(1, 2, 4, 8)), {},
     DTypeError, "share one dtype"),
    ("meta_device", lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8, device="meta"), torch.randn(1, 2, 4, 8)),
     {}, DeviceError, "one device"),
    ("batch_mismatch", lambda: (torch.randn(2, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)), {},
     ShapeError, "batch sizes differ"),
    ("padding_mask_batch", lambda: (torch.randn(3, 2, 4, 8),) * 3, {"mask": masks.padding([4, 2])}, MaskError,
     "built for batch size 2"),
    ("bad_dropout", lambda: (torch.randn(1, 2, 4, 8),) * 3, {"dropout_p": 1.5}, ShapeError, "dropout_p"),
]


@pytest.mark.parametrize("name,make,kwargs,exc,msg", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_typed_error(name, make, kwargs, exc, msg):
    q, k, v = make()
    with pytest.raises(exc, match=msg) as info:
        headlab.attention(q, k, v, **kwargs)
    assert isinstance(info.value, HeadlabError)


def test_dropout_is_applied_and_scaled():
    torch.manual_seed(0)
    q = k = torch.zeros(1, 1, 64, 4)
    v = torch.ones(1, 1, 64, 4)
    for backend in ("reference", "sdpa"):
        out = headlab.attention(q, k, v, dropout_p=0.5, backend=backend)
        # uniform weights 1/64; dropout keeps ~half of them scaled by 2: rows average to ~1
        assert 0.7 < out.mean().item() < 1.3
        assert out.std().item() > 0.05
