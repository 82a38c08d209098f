"""The cost model: the seed's figure, FLOPs against torch's counter, bytes against measured memory."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import headlab
from headlab import costs
from headlab.attention import backends
from headlab.errors import CostModelError, MemoryBudgetError, UnknownBackendError


def test_seed_text_32_gib():
    seed = costs.AttentionShape(heads=32, q_len=4096, layers=32, dtype="float16")
    ref = costs.estimate(seed, "reference")
    assert 4096 * 4096 * 32 == 536_870_912  # values per layer, as the text says
    assert ref.attention_weights_bytes == 34_359_738_368 == 32 * 2**30
    assert costs.estimate(seed, "sdpa").attention_weights_bytes == 0


def test_every_registered_backend_has_a_formula():
    shape = costs.AttentionShape(heads=4, q_len=256)
    table = costs.estimate_all(shape)
    assert set(table) == set(backends.names())
    for name, c in table.items():
        assert c.forward_flops > 0 and c.backward_flops > 0 and c.working_set_bytes > 0, name


def test_missing_formula_is_an_error_not_a_zero(monkeypatch):
    from headlab.costs import model

    monkeypatch.delitem(model._FORMULAS, "sdpa")
    with pytest.raises(CostModelError, match="no cost formula"):
        costs.estimate(costs.AttentionShape(), "sdpa")
    with pytest.raises(UnknownBackendError, match="known backends"):
        costs.estimate(costs.AttentionShape(), "nope")


FLOP_CASES = [  # (batch, heads, kv_heads, q_len, kv_len, head_dim, v_dim, causal)
    (1, 4, 4, 128, 128, 64, 64, False),
    (2, 8, 2, 113, 203, 40, 40, False),
    (1, 2, 2, 96, 96, 32, 48, True),
]


@pytest.mark.parametrize("case", FLOP_CASES)
def test_reference_flops_equal_flop_counter(case):
    B, H, Hkv, Lq, Lk, d, dv, causal = case
    q = torch.randn(B, H, Lq, d, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, d, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, dv, requires_grad=True)
    with FlopCounterMode(display=False) as fwd_counter:
        out = headlab.attention(q, k, v, causal=causal, backend="reference")
    with FlopCounterMode(display=False) as bwd_counter:
        out.sum().backward()
    shape = costs.AttentionShape(batch=B, heads=H, kv_heads=Hkv, q_len=Lq, kv_len=Lk, head_dim=d, v_dim=dv,
                                 causal=causal)
    est = costs.estimate(shape, "reference")
    assert est.forward_flops == fwd_counter.get_total_flops()
    assert est.backward_flops == bwd_counter.get_total_flops()


_MEASURE = r"""
import json, sys, torch, headlab
L, H, dtype = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3])
torch.set_num_threads(1)
q, k, v = (torch.randn(1, H, L, 64, dtype=dtype) for _ in range(3))
headlab.attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], backend="reference")  # warm up
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak resident set (VmHWM) to the current one
before = status("VmRSS:")
out = headlab.attention(q, k, v, backend="reference")
print(json.dumps({"growth": status("VmHWM:") - before}))
"""


@pytest.mark.parametrize("seq_len", [2048, 4096, 8192])
def test_predicted_working_set_within_10_percent_of_measured_peak(seq_len):
    heads, dtype = 2, "float32"
    res = subprocess.run([sys.executable, "-c", _MEASURE, str(seq_len), str(heads), dtype],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    growth = json.loads(res.stdout.strip().splitlines()[-1])["growth"]
    shape = costs.AttentionShape(heads=heads, q_len=seq_len, head_dim=64, dtype=dtype)
    predicted = costs.estimate(shape, "reference").working_set_bytes
    assert abs(predicted - growth) <= 0.10 * growth, (predicted, growth)


def test_memory_guard_refuses_before_allocating(monkeypatch):
    # 200,000 tokens: the reference map would need 160 GB; torch would fail differently if it tried
    q = k = v = torch.randn(1, 1, 200_000, 1)
    with pytest.raises(MemoryBudgetError) as info:
        headlab.attention(q, k, v, backend="reference")
    err = info.value
    assert err.estimate_bytes >= 2 * 200_000**2 * 4
    assert "GiB" in str(err) and "available" in str(err) and "backend=" in str(err)
    monkeypatch.setenv("HEADLAB_MEMORY_LIMIT", str(1 << 20))  # pretend only 1 MiB is free
    q = k = v = torch.randn(1, 2, 1024, 8)
    with pytest.raises(MemoryBudgetError, match=r"needs about 16\.\d MiB but only 1\.0 MiB"):
        headlab.attention_weights(q, k)
    headlab.attention(q, k, v, backend="sdpa")  # the fused kernel still runs


def test_roofline_takes_hardware_as_an_argument():
    shape = costs.AttentionShape(heads=8, q_len=4096, head_dim=64, dtype="float16")
    hw = costs.Hardware("toy", peak_flops=1e12, bandwidth=1e11)
    c = costs.estimate(shape, "reference")
    assert hw.seconds(c) == max(c.forward_flops / 1e12, c.bytes_moved / 1e11)


# -- backends own their formula: the registry refuses one without, and estimate asks the backend ---------------

def test_a_backend_without_a_cost_formula_cannot_be_registered(monkeypatch):
    from headlab.attention.backends import base
    from headlab.costs import model

    for mod, name in ((base, "_REGISTRY"), (model, "_FORMULAS"), (model, "_BACKENDS")):
        monkeypatch.setattr(mod, name, dict(getattr(mod, name)))  # whatever happens, the real tables stay as they are

    class NoFormula(backends.Backend):
        name = "no-formula"
        summary = "a backend that forgot its cost formula"
        capabilities = backends.Capabilities()

    with pytest.raises(CostModelError, match="declares no cost formula.*cost = staticmethod"):
        backends.register(NoFormula)
    assert "no-formula" not in backends.names() and "no-formula" not in costs.formulas()

    def toy_cost(shape, backend):
        return costs.AttentionCost(backend=backend.name, forward_flops=1, backward_flops=2, attention_weights_bytes=0,
                                   working_set_bytes=3, bytes_moved=4, saved_for_backward_bytes=5)

    class WithFormula(NoFormula):
        name = "with-formula"
        cost = staticmethod(toy_cost)

    backends.register(WithFormula)  # the formula goes to the cost model with the backend
    assert costs.estimate(costs.AttentionShape(), "with-formula").working_set_bytes == 3
    assert set(costs.estimate_all(costs.AttentionShape())) == set(backends.names())


def test_estimate_uses_the_formula_each_backend_declares():
    from headlab.attention.backends.linear import from_string
    from headlab.attention.backends.tiled import TiledBackend
    from headlab.costs import model

    shape = costs.AttentionShape(heads=4, kv_heads=2, q_len=300, head_dim=32, causal=True, layers=2)
    for name in backends.names():
        b = backends.get(name)
        formula = type(b).cost
        assert model._FORMULAS[name] is formula, name
        assert costs.estimate(shape, name) == formula(shape, b), name
    # a configured instance is costed as configured: its tiles, its feature map
    small = TiledBackend(64, 32)
    assert costs.estimate(shape, small).forward_flops == 2 * costs.tiled.tiled_flops(shape, 64, 32)[0]
    assert costs.estimate(shape, small) != costs.estimate(shape, "tiled")
    favor = from_string("favor:128")
    assert costs.estimate(shape, favor) == costs.linear.linear_cost(shape, feature_map="favor", num_features=128)


_ENGINE_IMPORT = re.compile(
    r"^\s*(?:from|import)\s+headlab\.(?:distributed|attention\.(?:backends|stats|core|module|measure))\b"
    r"|^\s*from\s+headlab\.attention\s+import\s+.*\b(?:backends|stats|core|module|measure)\b"
    r"|^\s*from\s+headlab\s+import\s+.*\bdistributed\b"
    r"|import_module\(\s*[\"']headlab\.(?:distributed|attention\.(?:backends|stats))", re.M)


def test_costs_imports_no_engine_and_nothing_of_distributed():
    """costs reads headlab.spec only; the backends bring their formulas to it (grep, lazy imports included)."""
    root = Path(headlab.__file__).parent / "costs"
    found = {str(p.relative_to(root)): m.group(0).strip() for p in root.rglob("*.py")
             for m in [_ENGINE_IMPORT.search(p.read_text(encoding="utf-8"))] if m}
    assert not found, found
