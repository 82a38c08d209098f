"""The "sparse" backend: exact w.r.t. the masked softmax (FlashAttention error rule), visits only
non-empty tiles, and its cost model counts exactly the FLOPs the kernel executes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import headlab
from headlab import costs, masks
from headlab.attention.backends import _threads
from headlab.attention.backends import sparse as sp
from headlab.attention.backends.sparse import kernel as sp_kernel
from headlab.errors import BackendUnsupportedError
from headlab.testing import compare_backend


def _qkv(b, h, hkv, lq, lk, d, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, lk, dv or d, generator=g, dtype=dtype)
    return q, k, v


def _empty_rows_layout():
    lay = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(3)) > 0.5
    lay[0, 1] = False  # head 0: query block 1 sees nothing
    lay[1, :, 0] = True
    return masks.block_layout(lay, 32)


# The FlashAttention rule on the shared case table (tests/cases.py) runs in tests/test_core.py
# for every backend, sparse included (what it cannot serve is skipped with its reason).


def test_fully_masked_rows_are_zero_with_zero_grads():
    q, k, v = _qkv(1, 2, 2, 128, 128, 16)
    q.requires_grad_(True)
    m = _empty_rows_layout()
    out = headlab.attention(q, k, v, mask=m, backend="sparse")
    assert torch.isfinite(out).all()
    assert (out[0, 0, 32:64] == 0).all()  # query block 1 of head 0 sees no key
    assert out[0, 1, 32:64].abs().sum() > 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[0, 0, 32:64] == 0).all()


def test_float64_and_bfloat16():
    q, k, v = _qkv(1, 2, 2, 150, 150, 16, dtype=torch.float64)
    assert compare_backend("sparse", q, k, v, mask=masks.sliding_window(30), causal=True).ok
    q, k, v = _qkv(1, 2, 2, 150, 150, 16, dtype=torch.bfloat16)
    r = compare_backend("sparse", q, k, v, mask=masks.sliding_window(30), grads=False)
    assert r.ok, r.failures()
    out = headlab.attention(q, k, v, mask=masks.sliding_window(30), backend="sparse")
    assert out.dtype == torch.bfloat16


def test_registration_and_refusals():
    row = {r["name"]: r for r in headlab.backends()}["sparse"]
    assert row["exact"] and not row["materializes"] and row["priority"] == 50
    q, k, v = _qkv(1, 2, 2, 16, 16, 8)
    # a call without a mask visits every tile, and is exact
    torch.testing.assert_close(headlab.attention(q, k, v, backend="sparse"),
                               headlab.attention(q, k, v, backend="reference"), atol=1e-5, rtol=1e-5)
    with pytest.raises(BackendUnsupportedError, match="additive float tensor masks"):
        headlab.attention(q, k, v, mask=torch.zeros(16, 16), backend="sparse")
    with pytest.raises(BackendUnsupportedError, match="dropout"):
        headlab.attention(q, k, v, causal=True, dropout_p=0.1, backend="sparse")
    # auto keeps preferring sdpa for a masked call
    from headlab.attention.core import resolve_backend
    from headlab.spec.attention_spec import validate
    spec, _ = validate(q, k, v, mask=masks.sliding_window(2))
    assert resolve_backend("auto", spec).name != "sparse"


def test_bool_tensor_masks_skip_their_empty_tiles(monkeypatch):
    """A boolean tensor mask runs as a mask function reading it: the plan visits only the tiles it
    leaves non-empty, and the result (and gradients) equal the reference's."""
    from headlab.attention.backends.sparse import tensor_mask

    g = torch.Generator().manual_seed(3)
    B, H, Hkv, L = 2, 4, 2, 300
    q, k, v = (torch.randn(B, h, L, 16, generator=g, dtype=torch.float64, requires_grad=True) for h in (H, Hkv, Hkv))
    band = (torch.arange(L)[:, None] - torch.arange(L)[None, :]).abs() <= 40  # (L, L)
    mask = band.expand(B, 1, L, L).clone()
    mask[1, ..., 250:] = False  # batch 1: padded keys
    ref = headlab.attention(q, k, v, mask=mask, backend="reference")
    got = headlab.attention(q, k, v, mask=mask, backend="sparse")
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
    do = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    fn = tensor_mask(mask)
    plan = sp.plan_for(fn, B, H, Hkv, L, L)
    bm = sp.block_map(fn, L, L, B, H)
    assert plan.tiles == sp.visited_tiles(bm, B, H) < bm.num_tiles * B * H  # the band's empty tiles are skipped


def _kernel_flops(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


# the cost model counts exactly the tiles the kernel computes
COST_CASES = [
    ("window_gqa", (1, 4, 2, 700, 700, 32, 32), masks.sliding_window(100), False),
    ("bigbird_odd", (2, 2, 2, 450, 390, 16, 24), masks.bigbird(64, 3, 1, 1, seed=2), False),
    ("causal_docs", (1, 2, 1, 513, 513, 16, 16), masks.documents([200, 313]), True),
    ("per_head_layout", (1, 2, 2, 128, 128, 16, 16), _empty_rows_layout(), False),
]


@pytest.mark.parametrize("name, dims, mask, causal", COST_CASES, ids=[c[0] for c in COST_CASES])
def test_predicted_flops_equal_counted(name, dims, mask, causal):
    b, h, hkv, lq, lk, d, dv = dims
    q, k, v = _qkv(b, h, hkv, lq, lk, d, dv)
    q.requires_grad_(True)
    shape = costs.AttentionShape(batch=b, heads=h, kv_heads=hkv, q_len=lq, kv_len=lk, head_dim=d, v_dim=dv,
                                 mask=mask, causal=causal)
    pred = costs.estimate(shape, "sparse")
    out = None

    def fwd():
        nonlocal out
        out = headlab.attention(q, k, v, mask=mask, causal=causal, backend="sparse")

    assert _kernel_flops(fwd) == pred.forward_flops
    assert _kernel_flops(lambda: out.backward(torch.ones_like(out))) == pred.backward_flops
    # the plan the kernel ran visits exactly the non-empty tiles of the block map
    eff = sp.effective_mask(mask, causal)
    plan = sp.plan_for(eff, b, h, hkv, lq, lk)
    bm = sp.block_map(eff, lq, lk, b, h)
    assert plan.tiles == sp.visited_tiles(bm, b, h) == costs.sparse.visited_tiles(shape)
    assert plan.tiles < bm.num_tiles * b * h or name == "per_head_layout"


def test_compute_scales_with_visited_tiles():
    # doubling the length of a sliding window doubles the FLOPs (dense would quadruple)
    f = [costs.estimate(costs.AttentionShape(heads=8, q_len=n, head_dim=64, mask=masks.sliding_window(256)),
                        "sparse").forward_flops for n in (8192, 16384)]
    assert 1.95 < f[1] / f[0] < 2.05


def test_memory_does_not_grow_quadratically():
    # peak bytes allocated by one forward + backward, counted with a dispatch-level tracker
    from torch.utils._python_dispatch import TorchDispatchMode

    class Peak(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    self.peak = max(self.peak, t.numel() * t.element_size())
            return out

    biggest = []
    for n in (1024, 4096):
        q, k, v = _qkv(1, 2, 2, n, n, 16)
        q.requires_grad_(True)
        with Peak() as p:
            out = headlab.attention(q, k, v, mask=masks.sliding_window(64), backend="sparse")
            out.sum().backward()
        biggest.append(p.peak)
    # 4x the length: the largest tensor grows at most about linearly (quadratic would be 16x) and
    # stays far below one n x n map per head
    assert biggest[1] <= 6 * biggest[0]
    assert biggest[1] < 4096 * 4096 * 4 / 4


def test_threaded_forward_equals_serial(monkeypatch):
    """The forward's units run in a thread pool when torch has more than one thread; the result
    must equal the serial result (each unit writes disjoint rows) and the reference. Covers the
    strided-view path (a pure sliding window: consecutive key blocks, evenly spaced heads) and
    the gathered path (a global token breaks the consecutive blocks), with GQA and an odd length."""
    q, k, v = _qkv(1, 6, 2, 1100, 1100, 32)
    n = torch.get_num_threads()
    for mask in (masks.sliding_window(200), masks.sliding_window(200) | masks.global_tokens([3])):
        views = [u[-1] is not None for u in sp_kernel._units(sp.plan_for(mask, 1, 6, 2, 1100, 1100))]
        assert len(views) > 1 and all(views) == (mask.name == masks.sliding_window(200).name)
        torch.set_num_threads(2)
        try:
            monkeypatch.setattr(_threads, "THREADED", True)
            threaded = headlab.attention(q, k, v, mask=mask, backend="sparse")
            assert torch.get_num_threads() == 2  # restored after the pool
            monkeypatch.setattr(_threads, "THREADED", False)
            serial = headlab.attention(q, k, v, mask=mask, backend="sparse")
        finally:
            torch.set_num_threads(n)
        torch.testing.assert_close(threaded, serial, atol=1e-6, rtol=1e-5)
        ref = headlab.attention(q, k, v, mask=mask, backend="reference")
        torch.testing.assert_close(threaded, ref, atol=2e-5, rtol=1e-4)
