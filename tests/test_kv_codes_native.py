"""The compiled kernel's decode attention on KIVI's codes (``csrc/codes.cpp``) against the PyTorch products of
:mod:`headlab.decode.codes` and against a float64 oracle written from the definition (read every key and value
back as ``code * scale + zero``, then ``q . k`` and ``sum_t p_t v_t``).

Shapes chosen to break the kernel's work units: more tokens than one unit (1,024), a first key group cut short
(a window), groups of 32, 64 and 128 tokens, value groups that split a byte (groups of 2 channels at 2 bits),
2, 4 and 8 bits, scales stored in float32, float16 and bfloat16, 3 query rows per kv head and a batch of 2.
"""

from __future__ import annotations

import pytest
import torch

from headlab import kv
from headlab.attention.backends import native_codes
from headlab.decode import quant
from headlab.decode.cache import HeadLayer
from headlab.decode.codes import key_scores, value_output
from tests.conftest import require_native

SLOW = pytest.mark.slow


def _keys(bits, group, head, t, dtype, d=64):
    """Keys of ``t`` tokens quantized as a store holds them: a first row of ``head`` tokens, then rows of ``group``."""
    k = (torch.randn(2, 3, t, d) * torch.linspace(0.2, 4.0, d)).to(dtype)
    parts = [quant.quantize_keys(k[:, :, :head], bits, head)]
    parts += [quant.quantize_keys(k[:, :, head:], bits, group)] if t > head else []
    return tuple(torch.cat([p[i] for p in parts], 2) for i in range(3))


def _oracle_keys(codes, scale, zero, bits, group, head):
    t = codes.shape[2]
    rows = torch.tensor([0 if j < head else 1 + (j - head) // group for j in range(t)])
    c = quant.unpack(codes, bits).double()
    return c * scale.double().index_select(2, rows) + zero.double().index_select(2, rows)


def _oracle_values(codes, scale, zero, bits):
    c = quant.unpack(codes, bits).double()
    B, h, t, dv = c.shape
    G = scale.shape[-1]
    return (c.reshape(B, h, t, G, dv // G) * scale.double()[..., None] + zero.double()[..., None]).reshape(c.shape)


KEY_CASES = [(4, 32, 32, torch.float16), (4, 64, 5, torch.bfloat16), (2, 128, 128, torch.float32),
             (8, 32, 7, torch.float16), pytest.param(2, 32, 1, torch.bfloat16, marks=SLOW),
             pytest.param(4, 128, 100, torch.float32, marks=SLOW)]


@pytest.mark.parametrize(("bits", "group", "head", "dtype"), KEY_CASES)
def test_the_kernels_key_scores_equal_the_definition_and_the_pytorch_path(bits, group, head, dtype):
    require_native()
    torch.manual_seed(bits * group + head)
    t = head + 41 * group  # past one work unit of 1,024 tokens
    codes, scale, zero = _keys(bits, group, head, t, dtype)
    q = torch.randn(2, 3, 3, 64)
    got = native_codes.key_scores(q, codes, scale, zero, bits=bits, group=group, head=head)
    assert got is not None and got.shape == (2, 3, 3, t) and got.dtype == torch.float32
    want = q.double() @ _oracle_keys(codes, scale, zero, bits, group, head).transpose(-1, -2)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    torch_path = key_scores(q, codes, scale, zero, bits=bits, group=group, head=head, native=False)
    torch.testing.assert_close(got, torch_path, rtol=1e-5, atol=1e-4)


# (bits, group, dtype, dv): the kernel sums whole vectors of 16 (AVX-512) or 8 channels in registers when a group's
# bytes are whole vectors (dv 64 and 32: four and two at a time; 80: four, then one; 96: four, then two), and
# token by token otherwise (a group of 2 or 4 channels at 2 and 4 bits)
VALUE_CASES = [(4, 32, torch.float16, 64), (4, 64, torch.bfloat16, 64), (2, 2, torch.float32, 64),
               (8, 16, torch.float16, 80), (4, 32, torch.float32, 32), (8, 32, torch.bfloat16, 96),
               pytest.param(2, 8, torch.float16, 64, marks=SLOW), pytest.param(4, 4, torch.float32, 64, marks=SLOW)]


@pytest.mark.parametrize(("bits", "group", "dtype", "dv"), VALUE_CASES)
def test_the_kernels_value_output_equals_the_definition_and_the_pytorch_path(bits, group, dtype, dv):
    require_native()
    torch.manual_seed(bits + group + dv)
    t = 2500  # three work units, the last partial (and a last block of 4 tokens)
    codes, scale, zero = quant.quantize_values(torch.randn(2, 3, t, dv).to(dtype), bits, group)
    p = torch.softmax(torch.randn(2, 3, 3, t) * 3, -1)
    got = native_codes.value_output(p, codes, scale, zero, bits=bits)
    assert got is not None and got.shape == (2, 3, 3, dv)
    want = p.double() @ _oracle_values(codes, scale, zero, bits)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, value_output(p, codes, scale, zero, bits=bits, native=False), rtol=1e-5, atol=1e-5)


def test_a_nan_in_the_cache_stays_nan():
    """A NaN key or value gives NaN scales: the scores of its group and every output it weighs are NaN, not a
    plausible number."""
    require_native()
    k = torch.randn(1, 1, 64, 64)
    k[0, 0, 40, 3] = float("nan")
    codes, scale, zero = quant.quantize_keys(k, 4, 32)
    s = native_codes.key_scores(torch.randn(1, 1, 1, 64), codes, scale, zero, bits=4, group=32, head=32)
    assert torch.isnan(s[..., 32:]).all() and not torch.isnan(s[..., :32]).any()
    v = torch.randn(1, 1, 64, 64)
    v[0, 0, 10, 5] = float("nan")
    vc = quant.quantize_values(v, 4, 32)
    out = native_codes.value_output(torch.full((1, 1, 1, 64), 1 / 64), *vc, bits=4)
    assert torch.isnan(out[..., :32]).all() and not torch.isnan(out[..., 32:]).any()


@pytest.mark.parametrize("rule", [kv.full(bits=4, group=64, residual=0), kv.window(3, 1100, bits=2, group=32,
                                                                                   residual=64)])
def test_a_decode_on_the_kernel_equals_one_on_the_pytorch_products(rule):
    """The same steps through a quantized store with the kernel and with PyTorch's products: the same outputs."""
    require_native()
    torch.manual_seed(3)
    N, prefill, d = 1300, 1250, 64
    k, v, q = torch.randn(1, 3, N, d) * torch.linspace(0.2, 4.0, d), torch.randn(1, 3, N, d), torch.randn(1, 9, N, d)
    outs = []
    for use in (True, False):
        layer = HeadLayer([rule] * 3, n_heads=9)
        store = layer.groups[0]
        store.native = use
        layer.update(k[:, :, :prefill], v[:, :, :prefill])
        store.flush(prefill)
        got = []
        for n in range(prefill + 1, N + 1):
            view = layer.update(k[:, :, n - 1 : n], v[:, :, n - 1 : n])[0]
            got.append(view.headlab_attend(None, q[:, :, n - 1 : n], None, scaling=d**-0.5)[0])
        assert store.kq is not None and store.vq is not None
        outs.append(torch.cat(got, 2))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_the_kernel_declines_what_it_does_not_read(monkeypatch):
    """A storage dtype it does not read (float64), or no kernel (HEADLAB_NATIVE=0): None, and the PyTorch path answers."""
    codes, scale, zero = quant.quantize_keys(torch.randn(1, 1, 32, 8, dtype=torch.float64), 4, 32)
    q = torch.randn(1, 1, 1, 8)
    assert native_codes.key_scores(q, codes, scale, zero, bits=4, group=32, head=32) is None
    from headlab.attention.backends import native

    monkeypatch.setattr(native, "kernel", lambda: None)
    codes, scale, zero = quant.quantize_keys(torch.randn(1, 1, 32, 8), 4, 32)
    assert native_codes.key_scores(q, codes, scale, zero, bits=4, group=32, head=32) is None
    want = q.double() @ _oracle_keys(codes, scale, zero, 4, 32, 32).transpose(-1, -2)
    torch.testing.assert_close(key_scores(q, codes, scale, zero, bits=4, group=32, head=32).double(), want, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kernels_value_quantizer_gives_kivis_codes_scales_and_zeros(dtype):
    """The compiled quantizer a decode step stores its new value with is bit for bit ``quant.quantize_values`` (the
    definition): 2, 4 and 8 bits, groups of 2 to 64 channels, a group whose numbers are all equal (scale 0)."""
    require_native()
    torch.manual_seed(7)
    for bits in (2, 4, 8):
        for group in (2, 8, 32, 64):
            x = (torch.randn(2, 3, 50, 64) * torch.rand(2, 3, 50, 1) * 5).to(dtype)
            x[0, 0, 3, :group] = 1.5
            got = native_codes.quantize_values(x, bits, group)
            assert got is not None
            for g, w in zip(got, quant.quantize_values(x, bits, group)):
                assert g.dtype == w.dtype and torch.equal(g, w), (bits, group)


def test_the_kernels_value_quantizer_keeps_a_nan_group_nan():
    require_native()
    x = torch.randn(1, 1, 4, 64)
    x[0, 0, 2, 40] = float("nan")
    codes, scale, zero = native_codes.quantize_values(x, 4, 32)
    back = quant.dequantize_values(codes, scale, zero, bits=4)
    assert torch.isnan(back[0, 0, 2, 32:]).all() and not torch.isnan(back[0, 0, 2, :32]).any()
    assert not torch.isnan(back[0, 0, [0, 1, 3]]).any()
