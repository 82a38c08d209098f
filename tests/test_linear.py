"""The linear backend against a float64 reference of the same math, and FAVOR+ against softmax."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import headlab
from headlab import masks
from headlab.attention import backends
from headlab.attention.backends.linear import LinearBackend, LinearState, from_string, working_set_bytes
from headlab.spec.attention_spec import validate
from headlab.errors import BackendUnsupportedError, ConfigError, HeadlabError, ShapeError


# -- the reference: kernelised attention, materialised, float64 --------------------------------

def phi_of(backend: LinearBackend, x: torch.Tensor, scale: float) -> torch.Tensor:
    """The plain feature formula, no stabilisers."""
    if backend.feature_map == "elu":
        return F.elu(x) + 1
    if backend.feature_map == "relu":
        return F.relu(x)
    w = backend.projection(x.shape[-1], x.device, x.dtype)  # (m, D)
    xs = x * math.sqrt(scale)
    return torch.exp(xs @ w.T - 0.5 * (xs * xs).sum(-1, keepdim=True)) / math.sqrt(w.shape[0])


def reference(backend, q, k, v, *, causal=False, key_mask=None, scale=None):
    """A_ij = phi(q_i).phi(k_j) over visible j, rows normalised; out = A v. All float64."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    fq = phi_of(backend, q, scale)
    fk = phi_of(backend, k, scale).repeat_interleave(G, 1)  # (B, H, Lk, F)
    a = fq @ fk.transpose(-1, -2)  # (B, H, Lq, Lk)
    if key_mask is not None:
        a = a * key_mask.double()  # (B, 1 or H, 1, Lk)
    if causal:
        a = a * torch.ones(q.shape[2], k.shape[2], dtype=torch.float64).tril()
    den = a.sum(-1, keepdim=True)
    a = a / torch.where(den > 0, den, torch.ones_like(den))
    return a @ v.repeat_interleave(G, 1)


def _inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype=torch.float64, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64) * spread
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64) * spread
    v = torch.randn(B, Hkv, Lk, Dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _grads(fn, q, k, v, seed=1):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), go))


# name, backend kwargs, (B, H, Hkv, Lq, Lk, D, Dv), causal, mask kind
CASES = [
    ("elu-plain", dict(), (2, 4, 4, 17, 23, 8, 5), False, None),
    ("elu-causal-odd", dict(chunk_size=8), (1, 3, 3, 37, 37, 16, 7), True, None),
    ("elu-causal-lq<lk", dict(chunk_size=4), (1, 2, 2, 13, 29, 8, 8), True, None),
    ("elu-causal-lq>lk", dict(chunk_size=4), (1, 2, 2, 29, 13, 8, 8), True, None),
    ("elu-gqa-causal", dict(chunk_size=8), (2, 6, 2, 30, 30, 8, 6), True, None),
    ("elu-gqa-pad-fn", dict(), (3, 4, 2, 11, 19, 8, 8), False, "padding_fn"),
    ("elu-causal-pad-bool", dict(chunk_size=8), (2, 4, 4, 21, 21, 8, 8), True, "bool_b11k"),
    ("elu-gqa-perhead-mask", dict(chunk_size=8), (2, 4, 2, 16, 16, 8, 4), True, "bool_bh1k"),
    ("relu-plain", dict(feature_map="relu"), (1, 2, 2, 19, 19, 8, 8), False, None),
    ("relu-causal", dict(feature_map="relu", chunk_size=8), (1, 4, 2, 25, 25, 8, 8), True, "padding_fn"),
    ("favor-plain", dict(feature_map="favor", num_features=40), (2, 4, 4, 15, 21, 8, 8), False, None),
    ("favor-causal-gqa", dict(feature_map="favor", num_features=24, chunk_size=8), (1, 4, 2, 33, 33, 16, 8), True,
     None),
    ("favor-pad", dict(feature_map="favor", num_features=16), (3, 2, 2, 12, 12, 8, 8), True, "padding_fn"),
]


def _mask(kind, B, H, Lk):
    lengths = [max(0, Lk - 5 * b) for b in range(B)]
    if B >= 3:
        lengths[-1] = 0  # a batch element with every key padded: its rows are zeros
    keep = torch.arange(Lk).view(1, Lk) < torch.tensor(lengths).view(B, 1)  # (B, Lk)
    if kind is None:
        return None, None
    if kind == "padding_fn":
        return masks.padding(lengths), keep.view(B, 1, 1, Lk)
    if kind == "bool_b11k":
        return keep.view(B, 1, 1, Lk), keep.view(B, 1, 1, Lk)
    if kind == "bool_bh1k":  # a different key padding per query head
        per_head = torch.stack([torch.roll(keep, h, dims=1) for h in range(H)], dim=1).view(B, H, 1, Lk)
        return per_head, per_head
    raise AssertionError(kind)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_float64(case):
    name, kw, (B, H, Hkv, Lq, Lk, D, Dv), causal, mkind = case
    be = LinearBackend(**kw)
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, Dv)
    mask, key_mask = _mask(mkind, B, H, Lk)
    got = _grads(lambda q, k, v: headlab.attention(q, k, v, mask=mask, causal=causal, backend=be), q, k, v)
    want = _grads(lambda q, k, v: reference(be, q, k, v, causal=causal, key_mask=key_mask), q, k, v)
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), label
        err = float((a - b).abs().max()) / max(1.0, float(b.abs().max()))
        assert err < 1e-9, f"{name} {label}: {err}"


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("elu-causal-odd", "favor-causal-gqa", "elu-gqa-pad-fn")],
                         ids=lambda c: c[0])
def test_float32_close_to_float64_reference(case):
    name, kw, (B, H, Hkv, Lq, Lk, D, Dv), causal, mkind = case
    be = LinearBackend(**kw)
    q, k, v = _inputs(B, H, Hkv, Lq, Lk, D, Dv)
    mask, key_mask = _mask(mkind, B, H, Lk)
    got = _grads(lambda q, k, v: headlab.attention(q, k, v, mask=mask, causal=causal, backend=be),
                 q.float(), k.float(), v.float())
    want = _grads(lambda q, k, v: reference(be, q, k, v, causal=causal, key_mask=key_mask), q, k, v)
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float32
        rel = float((a.double() - b).norm() / b.norm().clamp_min(1e-12))
        assert rel < 2e-5, f"{name} {label}: {rel}"


def test_half_inputs_computed_in_float32():
    be = LinearBackend("favor", num_features=32)
    q, k, v = _inputs(1, 2, 2, 40, 40, 16, 16, spread=2.0)
    out = headlab.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, backend=be)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    want = reference(be, q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), causal=True)
    assert float((out.double() - want).abs().max()) < 2e-2


def test_favor_padded_keys_with_huge_exponents_keep_gradients_finite():
    # padded keys far larger than the real ones: their exponents must not overflow into inf * 0 = nan
    be = LinearBackend("favor", num_features=16)
    q, k, v = _inputs(1, 2, 2, 10, 10, 8, 8)
    k[:, :, 6:] *= 40.0
    mask = masks.padding([6])
    got = _grads(lambda q, k, v: headlab.attention(q, k, v, mask=mask, causal=True, backend=be), q.float(), k.float(),
                 v.float())
    want = _grads(lambda q, k, v: reference(be, q, k, v, causal=True, key_mask=mask.dense(1, 1, 1, 10)), q, k, v)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        assert float((a.double() - b).abs().max()) < 1e-4 * max(1.0, float(b.abs().max()))


def test_dead_rows_are_zero_not_nan():
    # relu: a query with all-negative features meets no key; a fully padded batch element too
    q = -torch.ones(2, 1, 3, 4)
    k = torch.rand(2, 1, 5, 4)
    v = torch.randn(2, 1, 5, 3)
    out = headlab.attention(q, k, v, backend=LinearBackend("relu"))
    assert torch.equal(out, torch.zeros_like(out))
    out = headlab.attention(k, k, v, mask=masks.padding([5, 0]), causal=True, backend="linear")
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))


# -- FAVOR+ approximates softmax --------------------------------------------------------------

def test_favor_error_falls_with_features():
    # FAVOR+'s variance grows like exp(|q|^2 + |k|^2) (scaled): moderate norms, as after a layer norm
    q, k, v = _inputs(1, 4, 4, 64, 64, 16, 16, dtype=torch.float64, seed=3, spread=0.5)
    exact = headlab.attention(q, k, v, backend="reference")
    errs = {}
    for m in (16, 64, 256, 1024):
        e = []
        for seed in range(4):
            out = headlab.attention(q, k, v, backend=LinearBackend("favor", num_features=m, seed=seed))
            e.append(float((out - exact).norm() / exact.norm()))
        errs[m] = sum(e) / len(e)
    assert errs[16] > errs[64] > errs[256] > errs[1024], errs
    assert errs[1024] < 0.35 * errs[16], errs  # Monte Carlo: about 1/sqrt(m) -> 1/8 expected
    assert errs[1024] < 0.15, errs


def test_favor_kernel_estimate_is_unbiased():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, generator=g, dtype=torch.float64) * 0.6
    y = torch.randn(8, generator=g, dtype=torch.float64) * 0.6
    truth = math.exp(float(x @ y))
    est = []
    for seed in range(400):  # independent seeded draws of an 8-feature (one orthogonal block) map
        be = LinearBackend("favor", num_features=8, seed=seed)
        w = be.projection(8)
        fx = torch.exp(w @ x - 0.5 * x @ x) / math.sqrt(8)
        fy = torch.exp(w @ y - 0.5 * y @ y) / math.sqrt(8)
        est.append(float(fx @ fy))
    est_t = torch.tensor(est, dtype=torch.float64)
    z = (est_t.mean() - truth) / (est_t.std() / math.sqrt(len(est)))
    assert abs(float(z)) < 4.0, (float(est_t.mean()), truth, float(z))
    assert float(est_t.std()) > 0  # a real random estimate, not a constant


def test_favor_projection_blocks_orthogonal_and_seeded():
    be = LinearBackend("favor", num_features=20, seed=3)
    w = be.projection(8)
    assert w.shape == (20, 8)
    for blk in (w[:8], w[8:16]):
        g = blk @ blk.T
        assert float((g - torch.diag(torch.diag(g))).abs().max()) < 1e-10
    assert torch.equal(w, LinearBackend("favor", num_features=20, seed=3).projection(8))
    assert not torch.equal(w, LinearBackend("favor", num_features=20, seed=4).projection(8))


def test_implied_weights_match_reference_rows():
    be = LinearBackend("favor", num_features=32)
    q, k, _ = _inputs(2, 4, 2, 20, 20, 8, 8)
    rows = [0, 7, 19]
    a = be.implied_weights(q, k, rows, causal=True, mask=masks.padding([20, 12]))
    fq = phi_of(be, q[:, :, rows], 1 / math.sqrt(8))
    fk = phi_of(be, k, 1 / math.sqrt(8)).repeat_interleave(2, 1)
    want = fq @ fk.transpose(-1, -2)  # (B, H, 3, 20)
    want = want * (torch.arange(20).view(1, -1) <= torch.tensor(rows).view(-1, 1))
    want[1, :, :, 12:] = 0
    want = want / want.sum(-1, keepdim=True)
    assert a.shape == (2, 4, 3, 20)
    assert torch.allclose(a, want, atol=1e-12)


# -- the recurrent step -----------------------------------------------------------------------

STEP_CASES = [
    ("elu", dict(), 1.0),
    ("relu", dict(feature_map="relu"), 1.0),
    ("favor", dict(feature_map="favor", num_features=24), 1.0),
    ("favor-large-keys", dict(feature_map="favor", num_features=24), 6.0),  # offsets keep exp() finite
]


@pytest.mark.parametrize("case", STEP_CASES, ids=[c[0] for c in STEP_CASES])
def test_step_equals_causal_parallel(case):
    _, kw, spread = case
    be = LinearBackend(**kw, chunk_size=4)
    q, k, v = _inputs(2, 4, 2, 11, 11, 8, 5, spread=spread)
    par = headlab.attention(q, k, v, causal=True, backend=be)
    state, outs = None, []
    for t in range(11):
        o, state = be.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
        outs.append(o)
    assert isinstance(state, LinearState) and state.position == 11
    assert state.kv.shape == (2, 2, be.num_features(8), 5)  # O(F d_v) per kv head, whatever the length
    seq = torch.cat(outs, dim=2)
    assert torch.isfinite(seq).all()
    assert torch.allclose(seq, par, rtol=1e-9, atol=1e-11)


def test_step_float32_and_shape_errors():
    be = LinearBackend()
    q, k, v = _inputs(1, 2, 1, 6, 6, 4, 4, dtype=torch.float32)
    par = headlab.attention(q, k, v, causal=True, backend=be)
    state = None
    for t in range(6):
        o, state = be.step(q[:, :, t], k[:, :, t], v[:, :, t], state)
        assert torch.allclose(o, par[:, :, t], atol=1e-6)
    with pytest.raises(ShapeError, match="step"):
        be.step(q, k, v)
    with pytest.raises(ShapeError):
        be.step(q[:, :, 0], k[:, :, 0, :3], v[:, :, 0])


# -- redraw, train and eval -------------------------------------------------------------------

def test_redraw_train_and_eval():
    q, k, v = _inputs(1, 2, 2, 9, 9, 8, 8)
    be = LinearBackend("favor", num_features=16, redraw_every=2)
    run = lambda: headlab.attention(q, k, v, backend=be)  # noqa: E731
    a, b = run(), run()
    assert torch.equal(a, b)  # eval (the default): fixed
    be.redraw()
    c = run()
    assert not torch.allclose(a, c)  # explicit redraw on demand
    again = LinearBackend("favor", num_features=16)
    again.redraw()
    assert torch.equal(c, headlab.attention(q, k, v, backend=again))  # redraws are reproducible
    be.train()
    t1, t2, t3 = run(), run(), run()
    assert torch.equal(t1, c) and torch.equal(t1, t2)  # two calls per draw
    assert not torch.allclose(t2, t3)
    be.eval()
    e1, e2, e3 = run(), run(), run()
    assert torch.equal(e1, t3) and torch.equal(e1, e2) and torch.equal(e2, e3)
    with pytest.raises(ConfigError, match="redraw"):
        LinearBackend().redraw()


# -- configuration, registry and refusals -----------------------------------------------------

def test_configuration_and_from_string():
    assert isinstance(backends.get("linear"), LinearBackend) and backends.get("linear").feature_map == "elu"
    assert from_string("favor:256").num_features(64) == 256
    assert from_string("FAVOR").num_features(64) == 256
    assert from_string("favor:32:5").config.seed == 5
    assert from_string("relu").feature_map == "relu"
    assert from_string("elu+1").feature_map == "elu"
    for bad in ("favor:0", "favor:-3", "favor:x", "gelu", "elu:64", "favor:1:2:3"):
        with pytest.raises(ConfigError):
            from_string(bad)
    for kw in (dict(feature_map="favor", num_features=0), dict(feature_map="favor", num_features=-1),
               dict(feature_map="favor", num_features=2.5), dict(num_features=64), dict(chunk_size=0),
               dict(feature_map="tanh")):
        with pytest.raises(ConfigError):
            LinearBackend(**kw)
    with pytest.raises(ConfigError, match="positive"):
        LinearBackend("favor", num_features=0)


def test_auto_never_picks_linear():
    q = k = v = torch.randn(1, 2, 8, 4)
    spec, _ = validate(q, k, v)
    assert backends.choose(spec).name != "linear"
    caps = [b for b in headlab.backends() if b["name"] == "linear"][0]
    assert caps["exact"] is False and caps["returns_weights"] is False


REFUSALS = [
    ("full bool mask", dict(mask=torch.ones(8, 8, dtype=torch.bool).tril())),
    ("causal mask fn", dict(mask=masks.causal())),
    ("query-dependent fn", dict(mask=masks.padding([8]) & masks.causal_lower_right())),
    ("dropout", dict(dropout_p=0.1)),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_other_masks_refused(case):
    _, kw = case
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(BackendUnsupportedError, match="linear") as exc:
        headlab.attention(q, k, v, backend="linear", **kw)
    assert isinstance(exc.value, HeadlabError)
    if "mask" in kw:
        assert "sdpa" in str(exc.value) and "padding" in str(exc.value)


# -- memory: O(n d), never O(n d d_v) or O(n^2) ------------------------------------------------

class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_causal_memory_is_linear_in_n_times_d():
    n, H, D, C = 2048, 2, 32, 32
    be = LinearBackend(chunk_size=C)
    q, k, v = (torch.randn(1, H, n, D, requires_grad=True) for _ in range(3))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with _Largest() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = headlab.attention(q, k, v, causal=True, backend=be)
    out.sum().backward()
    per_position_state = H * n * D * (D + 1)  # what a cumsum over positions would hold: O(n d d_v)
    assert mode.largest <= H * n * (D + 1) * 2, mode.largest  # every buffer O(n d)
    assert mode.largest * 8 < per_position_state
    assert max(saved) <= H * n * (D + 1) * 2 and sum(saved) < 20 * H * n * D
    spec, _ = validate(q.detach(), k.detach(), v.detach(), causal=True)
    ws = [working_set_bytes(spec.with_(q_len=m, kv_len=m)) for m in (4096, 8192, 16384)]
    assert abs(ws[1] / ws[0] - 2) < 0.05 and abs(ws[2] / ws[1] - 2) < 0.05  # linear in n
