"""The cost model: the seed's figure, FLOPs against torch's counter, bytes against measured memory."""

from __future__ import annotations

import json
import subprocess
import sys

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
