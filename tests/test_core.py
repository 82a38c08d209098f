"""The functional core: parity of every dense backend with the float64 reference and with torch SDPA.

One named case table; each case is run on each backend under the FlashAttention error rule
(REFERENCES.md section 2) for outputs and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import headlab
from headlab import masks
from headlab.spec.blocks import block_map
from headlab.errors import (
    BackendUnsupportedError,
    ConfigError,
    DeviceError,
    DTypeError,
    HeadlabError,
    MaskError,
    ShapeError,
    UnknownBackendError,
)
from headlab.testing import compare_backend, plain_attention
from cases import BY_NAME, CASES, Case, make_inputs, skip_unless_supported


# Every exact backend on the shared case table; the default tile of tiled, and small tiles that
# break it. A combination a backend cannot serve is skipped with the backend's own reason.
BACKENDS = ["reference", "sdpa", "tiled", "sparse"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_backend_holds_the_flash_rule(case, backend):
    """max error <= 2x (out) / 3x (grads) and mean error <= 1.5x the plain same-precision
    implementation's (which computes in another order: the reference is not its own yardstick)."""
    q, k, v, mask = make_inputs(case)
    skip_unless_supported(backend, case, q, k, v, mask)
    report = compare_backend(backend, q, k, v, mask=mask, causal=case.causal, scale=case.scale)
    assert report.ok, report.failures()


def test_the_plain_yardstick_is_not_the_reference():
    """The rule's plain implementation computes in another order than the reference backend, so
    comparing the reference can fail (with backend='reference' against itself it never could)."""
    q, k, v, _ = make_inputs(BY_NAME["scale_8"])
    rep = compare_backend("reference", q, k, v, causal=True, scale=8.0)
    assert all(p > 0 for _, p, _ in rep.errors.values())  # the yardstick is not exact either
    out = headlab.attention(q, k, v, causal=True, scale=8.0, backend="reference")
    assert not torch.equal(out, plain_attention(q, k, v, causal=True, scale=8.0))  # another order


TORCH_CASES = [c for c in CASES if c.dtype == torch.float32 and c.mask not in ("plain_fn", "layout_empty_rows")
               and c.q_len * c.kv_len < 1 << 17]


@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: c.name)
def test_equals_torch_sdpa(case):
    """headlab.attention == torch's scaled_dot_product_attention with the same semantics."""
    q, k, v, mask = make_inputs(case)
    attn_mask = mask.dense(case.batch, case.heads, case.q_len, case.kv_len) if isinstance(mask, masks.MaskFn) else mask
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=case.causal, scale=case.scale,
                                              enable_gqa=case.heads != case.kv_heads)
    if attn_mask is not None:  # torch leaves fully masked rows at 0 on its flash path; headlab guarantees it
        vis = attn_mask if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask)
        expected = expected.masked_fill(~vis.any(-1, keepdim=True), 0.0)
    for backend in ("auto", "sdpa", "reference"):
        out = headlab.attention(q, k, v, mask=mask, causal=case.causal, scale=case.scale, backend=backend)
        # sharper logits (a larger scale) round larger: the rule's tests bound those, not this one
        torch.testing.assert_close(out, expected, atol=2e-6 if case.scale is None else 2e-5, rtol=1e-5)


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
            hinted = block_map(m, lq, lk, bq, bk).state
            from headlab.spec.blocks import _classify_dense
            dense = _classify_dense(m, lq, lk, bq, bk, 1, 1, torch.device("cpu"))
            assert torch.equal(hinted, dense), (m, lq, lk)


def test_auto_choice_and_explicit_refusal():
    q = k = v = torch.randn(1, 2, 8, 4)
    from headlab.attention import backends
    from headlab.spec.attention_spec import validate

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
    from headlab.spec.attention_spec import validate

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
    ("int_mask", lambda: (torch.randn(1, 2, 4, 8),) * 3, {"mask": torch.ones(4, 4, dtype=torch.long)}, MaskError,
     "boolean tensor .* or an additive float"),
    ("int_dtype", lambda: (torch.ones(1, 2, 4, 8, dtype=torch.long),) * 3, {}, DTypeError, "floating dtype"),
    ("mixed_dtypes", lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8).double(), torch.randn(1, 2, 4, 8)), {},
     DTypeError, "share one dtype"),
    ("meta_device", lambda: (torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8, device="meta"), torch.randn(1, 2, 4, 8)),
     {}, DeviceError, "one device"),
    ("batch_mismatch", lambda: (torch.randn(2, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)), {},
     ShapeError, "batch sizes differ"),
    ("padding_mask_batch", lambda: (torch.randn(3, 2, 4, 8),) * 3, {"mask": masks.padding([4, 2])}, MaskError,
     "built for batch size 2"),
    ("bad_dropout", lambda: (torch.randn(1, 2, 4, 8),) * 3, {"dropout_p": 1.5}, ConfigError, "dropout_p"),
    ("nan_scale", lambda: (torch.randn(1, 2, 4, 8),) * 3, {"scale": float("nan")}, ConfigError, "finite"),
    ("inf_scale", lambda: (torch.randn(1, 2, 4, 8),) * 3, {"scale": float("inf")}, ConfigError, "finite"),
    ("bad_score_mod", lambda: (torch.randn(1, 2, 4, 8),) * 3, {"score_mod": 3}, ConfigError, "score_mod"),
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


# The sdpa backend over every head-dim / grouping / mask / dtype combination it claims: torch's CPU
# flash op (taken for the log-sum-exp and for half-precision gradients of grouped heads) wants one
# head size for q, k and v, so value head dims that differ must be routed, not passed through.
SDPA_GRID = [
    Case(f"{str(dt)[6:]}_d{d}v{dv}_g{g}_{mask or 'nomask'}{'_causal' if causal else ''}", heads=4, kv_heads=4 // g,
         q_len=19, kv_len=27, head_dim=d, v_dim=dv, dtype=dt, mask=mask, causal=causal)
    for dt in (torch.float32, torch.float16, torch.bfloat16)
    for d, dv in ((16, 16), (24, 40), (59, 16))
    for g in (1, 2, 4)
    for mask, causal in ((None, False), (None, True), ("key_padding", False), ("additive", False), ("fn", False),
                         ("dead_rows", True))
]


@pytest.mark.parametrize("case", SDPA_GRID, ids=lambda c: c.name)
def test_sdpa_serves_every_head_dim_grouping_and_dtype(case):
    """Outputs and gradients under the flash rule, and the log-sum-exp against float64."""
    q, k, v, mask = make_inputs(case)
    report = compare_backend("sdpa", q, k, v, mask=mask, causal=case.causal)
    assert report.ok, report.failures()
    m64 = mask.double() if isinstance(mask, torch.Tensor) and mask.is_floating_point() else mask
    out, lse = headlab.attention(q.detach(), k.detach(), v.detach(), mask=mask, causal=case.causal, backend="sdpa",
                                 return_lse=True)
    ref, ref_lse = headlab.attention(q.detach().double(), k.detach().double(), v.detach().double(), mask=m64,
                                     causal=case.causal, backend="reference", return_lse=True)
    assert out.shape == ref.shape
    tol = 1e-4 if case.dtype == torch.float32 else 5e-2
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), ref, atol=tol * 10, rtol=tol * 10)


def _imports(path):
    import ast

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_the_mechanism_imports_nothing_above_it_and_has_no_cycle():
    """attention/ never imports the package root nor distributed/models/interpret/cli, its core (what the
    cost model reads: spec, masks, states, blocks ...) never imports costs either (the engines may: each
    backend declares its cost formula; tests/test_layers.py draws the layers), and its modules import
    each other without a cycle (masks never import the block map back)."""
    from pathlib import Path

    root = Path(headlab.__file__).parent
    core = ("spec", "masks", "states", "blocks", "visibility", "score_mods", "feature_maps", "guard")
    graph = {}
    for f in sorted((root / "attention").rglob("*.py")):
        mod = ".".join(("headlab",) + f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        higher = ("headlab.distributed", "headlab.models", "headlab.interpret", "headlab.cli")
        if mod.startswith(tuple(f"headlab.attention.{c}" for c in core)):
            higher += ("headlab.costs",)
        deps = set()
        for name in _imports(f):
            assert name != "headlab", f"{mod} imports the package root"
            assert not name.startswith(higher), f"{mod} imports {name}, a higher layer"
            if name.startswith("headlab.attention"):
                deps.add(name)
        graph[mod] = deps
    assert not any(d.startswith("headlab.spec.blocks") for m, ds in graph.items()
                   if m.startswith("headlab.spec.masks") for d in ds)

    def owner(dep):  # a module or the package that holds it
        while dep not in graph and "." in dep:
            dep = dep.rsplit(".", 1)[0]
        return dep

    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for d in graph.get(m, ()):
            d = owner(d)
            if d == m or d not in graph or m.startswith(d + "."):
                continue  # a package's own __init__ re-exporting its rooms is not a cycle
            assert state.get(d) != 1, "import cycle: " + " -> ".join(stack + [d])
            if d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
