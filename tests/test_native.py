"""The native engine (``headlab.attention.backends.native``): the one owner of the compiled kernel.

Its decision (:func:`native.declines`), composed band masks on the kernel's fast path against the
reference (the FlashAttention error rule of :func:`headlab.testing.compare_backend`), and that no
other module calls the raw kernel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import require_native
from headlab import masks
from headlab.attention.backends import native
from headlab.attention.spec import validate
from headlab.testing import compare_backend

ROOT = Path(__file__).resolve().parent.parent


def _qkv(lq=300, lk=300, h=4, hkv=2, d=16, dv=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, h, lq, d, generator=g, dtype=dtype), torch.randn(2, hkv, lk, d, generator=g, dtype=dtype),
            torch.randn(2, hkv, lk, dv, generator=g, dtype=dtype))


def _spy(monkeypatch) -> dict:
    """Count the engine's forward and backward calls."""
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        real = getattr(native, name)

        def wrapped(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(native, name, wrapped)
    return calls


# composed masks that are one band around the diagonal: the kernel's window fast path takes them
COMPOSED = [
    ("causal_and_window", masks.causal() & masks.sliding_window(40), False),
    ("window_and_is_causal", masks.sliding_window(25), True),  # sparse walks the mask ANDed with causal()
    ("overlapping_windows", masks.sliding_window(8) | masks.sliding_window(30, causal=True), False),
    ("window_minus_far_future", masks.sliding_window(50) & ~(~masks.causal() & ~masks.sliding_window(5)), False),
]


@pytest.mark.parametrize("backend", ["tiled", "sparse"])
@pytest.mark.parametrize("name,mask,causal", COMPOSED, ids=[c[0] for c in COMPOSED])
def test_composed_window_takes_the_kernel_and_matches_the_reference(backend, name, mask, causal, monkeypatch):
    require_native()
    q, k, v = _qkv()
    spec, norm = validate(q, k, v, mask=mask, causal=causal)
    assert native.declines(spec, norm, torch.float32) is None
    calls = _spy(monkeypatch)
    report = compare_backend(backend, q, k, v, mask=mask, causal=causal)
    assert report.ok, report.failures()
    assert calls["forward"] >= 1 and calls["backward"] >= 1, calls  # the kernel ran, forward and backward


def test_composed_window_statistics_take_the_kernel(monkeypatch):
    require_native()
    q, k, v = _qkv()
    mask = masks.causal() & masks.sliding_window(40)
    calls = []
    real = native.statistics
    monkeypatch.setattr(native, "statistics", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    import headlab

    st = headlab.attention_stats(q, k, v, mask=mask)
    assert calls == [1]
    w = headlab.attention_weights(q.double(), k.double(), mask=mask)
    torch.testing.assert_close(st.max_weight.double(), w.amax(-1), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(st.received.double(), w.sum(-2), atol=2e-5, rtol=2e-5)


# calls the kernel declines, each with its reason (the callers then run their PyTorch paths)
DECLINED = [
    ("float64", dict(dtype=torch.float64), {}, "float32"),
    ("future_band", dict(mask=~masks.causal() & masks.sliding_window(3)), {}, "band of offsets"),
    ("two_bands", dict(mask=masks.sliding_window(1) | ~masks.sliding_window(5)), {}, "band of offsets"),
    ("plain_function", dict(mask=masks.as_mask(lambda b, h, q, kv: q >= kv)), {}, "band of offsets"),
    ("dropout", {}, dict(dropout_p=0.1), "dropout"),
    ("score_mod", {}, dict(score_mod=masks.softcap(20.0)), "score_mod"),
    ("own_tiles", {}, dict(own_tiles=True), "tile sizes"),
]


@pytest.mark.parametrize("name,call,opts,reason", DECLINED, ids=[c[0] for c in DECLINED])
def test_declines_says_why(name, call, opts, reason):
    q, k, v = _qkv(lq=20, lk=20, dtype=call.get("dtype", torch.float32))
    spec, norm = validate(q, k, v, mask=call.get("mask"))
    ct = torch.float64 if spec.dtype == torch.float64 else torch.float32
    why = native.declines(spec, norm, ct, **opts)
    assert why is not None and reason in why, why


def test_declines_under_a_dispatch_mode():
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = _qkv(lq=20, lk=20)
    spec, _ = validate(q, k, v)
    with FlopCounterMode(display=False):
        assert "dispatch mode" in native.declines(spec, None, torch.float32)


def test_only_the_engine_calls_the_raw_kernel():
    """``mod.onepass(...)`` and ``mod.onepass_backward(...)`` appear in exactly one module: the engine."""
    for call in ("onepass", "onepass_backward"):
        pattern = re.compile(r"\." + call + r"\(")
        callers = sorted(str(p.relative_to(ROOT)) for folder in ("src", "benchmarks") for p in (ROOT / folder).rglob("*.py")
                         if pattern.search(p.read_text(encoding="utf-8")))
        assert callers == ["src/headlab/attention/backends/native.py"], (call, callers)
