"""MultiHeadAttention: interchangeable with torch.nn.MultiheadAttention, per-head views, head gates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import headlab
from headlab.errors import BackendUnsupportedError, ConfigError, HeadlabError, MaskError, ShapeError

# (name, torch MHA kwargs, kind of call)
MHA_CASES = [
    ("self", dict(embed_dim=32, num_heads=4, batch_first=True), "self"),
    ("self_not_batch_first", dict(embed_dim=32, num_heads=4, batch_first=False), "self"),
    ("cross_kdim_vdim", dict(embed_dim=32, num_heads=8, kdim=20, vdim=12, batch_first=True), "cross"),
    ("cross_same_dim", dict(embed_dim=24, num_heads=3, batch_first=True), "cross"),
    ("key_padding", dict(embed_dim=32, num_heads=4, batch_first=True), "key_padding"),
    ("causal", dict(embed_dim=32, num_heads=4, batch_first=True), "causal"),
    ("causal_and_padding", dict(embed_dim=48, num_heads=6, batch_first=True), "causal_padding"),
    ("no_bias", dict(embed_dim=16, num_heads=2, bias=False, batch_first=True), "self"),
]


def _torch_call(m, x, mem, kind, lq, lk):
    """Run torch's module with batch-first tensors; returns (out, per-head weights)."""
    kwargs = dict(need_weights=True, average_attn_weights=False)
    if kind in ("key_padding", "causal_padding"):
        kpm = torch.zeros(x.shape[0], lk, dtype=torch.bool)
        kpm[1, -3:] = True  # True = padding (torch convention)
        kwargs["key_padding_mask"] = kpm
    if kind in ("causal", "causal_padding"):
        kwargs["attn_mask"] = torch.ones(lq, lk, dtype=torch.bool).triu(1)  # True = NOT allowed (torch)
    q, kv = x, (mem if mem is not None else x)
    if not m.batch_first:
        out, w = m(q.transpose(0, 1), kv[0].transpose(0, 1) if isinstance(kv, tuple) else kv.transpose(0, 1),
                   kv[1].transpose(0, 1) if isinstance(kv, tuple) else kv.transpose(0, 1), **kwargs)
        return out.transpose(0, 1), w, kwargs
    k, v = kv if isinstance(kv, tuple) else (kv, kv)
    out, w = m(q, k, v, **kwargs)
    return out, w, kwargs


@pytest.mark.parametrize("name,kwargs,kind", MHA_CASES, ids=[c[0] for c in MHA_CASES])
def test_from_torch_parity(name, kwargs, kind):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(**kwargs).eval()
    ours = headlab.MultiHeadAttention.from_torch(m).eval()
    B, Lq, Lk = 2, 7, 7 if kind != "cross" and not name.startswith("cross") else 11
    x = torch.randn(B, Lq, m.embed_dim)
    mem = None
    if name.startswith("cross"):
        mem = (torch.randn(B, Lk, m.kdim), torch.randn(B, Lk, m.vdim))
    expected, w_expected, tk = _torch_call(m, x, mem, kind, Lq, Lk)
    call = {}
    if "key_padding_mask" in tk:
        call["key_padding_mask"] = tk["key_padding_mask"]
    if "attn_mask" in tk:
        call["causal"] = True
    key, value = mem if mem is not None else (None, None)
    out, w = ours(x, key, value, need_weights=True, **call)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, w_expected, atol=1e-5, rtol=1e-5)
    out_fast, w_none = ours(x, key, value, **call)  # auto backend, no weights
    assert w_none is None
    torch.testing.assert_close(out_fast, expected, atol=1e-5, rtol=1e-5)


def test_per_head_views_reproduce_the_equations():
    torch.manual_seed(1)
    mha = headlab.MultiHeadAttention(24, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 5, 24)
    out, w = mha(x, need_weights=True)
    heads = []
    for h in range(4):
        p = mha.head_weights(h)
        g = h // 2
        qh = x @ p["W_Q"] + mha.q_proj.bias.view(4, 6)[h]
        kh = x @ p["W_K"] + mha.k_proj.bias.view(2, 6)[g]
        vh = x @ p["W_V"] + mha.v_proj.bias.view(2, 6)[g]
        a = torch.softmax(qh @ kh.transpose(-1, -2) / 6 ** 0.5, -1)
        torch.testing.assert_close(a, w[:, h], atol=1e-6, rtol=1e-5)
        heads.append(a @ vh @ p["W_O"])  # head h's contribution through its W^O block
    torch.testing.assert_close(sum(heads) + mha.out_proj.bias, out, atol=1e-5, rtol=1e-5)
    # views share storage with the layers
    with torch.no_grad():
        mha.W_O[1].zero_()
    assert mha.out_proj.weight[:, 6:12].abs().sum() == 0


def test_head_gate_zero_equals_zeroed_W_O_block_and_is_differentiable():
    torch.manual_seed(2)
    mha = headlab.MultiHeadAttention(32, 4).eval()
    x = torch.randn(1, 6, 32)
    mha.head_gate[2] = 0.0
    gated, _ = mha(x)
    mha.head_gate.fill_(1.0)
    with torch.no_grad():
        mha.W_O[2].zero_()
    zeroed, _ = mha(x)
    torch.testing.assert_close(gated, zeroed)
    mha.head_gate.requires_grad_(True)
    out, _ = mha(x, backend="sdpa")
    out.pow(2).sum().backward()
    assert mha.head_gate.grad is not None and mha.head_gate.grad.shape == (4,)
    assert mha.head_gate.grad[2] == 0  # head 2's W^O block is zero: no effect


def test_gqa_module_matches_reference_backend_and_trains():
    torch.manual_seed(3)
    mha = headlab.MultiHeadAttention(64, 8, num_kv_heads=2)
    x = torch.randn(2, 9, 64, requires_grad=True)
    a, _ = mha(x, causal=True, backend="reference")
    b, _ = mha(x, causal=True, backend="sdpa")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    b.sum().backward()
    assert mha.k_proj.weight.grad.shape == (16, 64)


def test_module_errors():
    with pytest.raises(ConfigError, match="not divisible"):
        headlab.MultiHeadAttention(30, 4)
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        headlab.MultiHeadAttention(32, 4, num_kv_heads=3)
    mha = headlab.MultiHeadAttention(16, 2)
    with pytest.raises(MaskError, match="True = padding"):
        mha(torch.randn(1, 3, 16), key_padding_mask=torch.zeros(1, 3))
    with pytest.raises(MaskError, match="shape"):
        mha(torch.randn(1, 3, 16), key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(HeadlabError, match="add_bias_kv"):
        headlab.MultiHeadAttention.from_torch(nn.MultiheadAttention(16, 2, add_bias_kv=True))


@pytest.mark.parametrize("kind", ["bool", "float", "per_head"])
def test_torch_attn_mask_keyword_has_torchs_meaning(kind):
    """Ported code passes torch's attn_mask (bool True = NOT allowed; float added): same output."""
    torch.manual_seed(3)
    m = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    ours = headlab.MultiHeadAttention.from_torch(m).eval()
    x = torch.randn(2, 9, 32)
    if kind == "bool":
        am = torch.rand(9, 9) > 0.7
        am.fill_diagonal_(False)  # every query keeps a key
    elif kind == "float":
        am = torch.randn(9, 9)
    else:
        am = torch.rand(2 * 4, 9, 9) > 0.7
        am[:, range(9), range(9)] = False
    want, w_want = m(x, x, x, attn_mask=am, need_weights=True, average_attn_weights=False)
    got, w = ours(x, attn_mask=am, need_weights=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, w_want, atol=1e-5, rtol=1e-5)
    with pytest.raises(MaskError, match="not both"):
        ours(x, attn_mask=am, mask=torch.ones(9, 9, dtype=torch.bool))
    with pytest.raises(MaskError, match="torch's shape"):
        ours(x, attn_mask=torch.zeros(3, 9, 9, dtype=torch.bool))


def test_wrong_width_says_which_dimension():
    mha = headlab.MultiHeadAttention(512, 8)
    with pytest.raises(ShapeError, match=r"query has 256 features .* expects embed_dim=512"):
        mha(torch.randn(2, 10, 256))
    cross = headlab.MultiHeadAttention(16, 2, kdim=6, vdim=5)
    with pytest.raises(ShapeError, match="key has 16 features .* kdim=6"):
        cross(torch.randn(1, 3, 16), torch.randn(1, 4, 16), torch.randn(1, 4, 5))


def test_weights_never_silently_replace_an_explicit_backend():
    mha = headlab.MultiHeadAttention(16, 2)
    x = torch.randn(1, 5, 16)
    _, w = mha(x, need_weights=True)  # auto: the reference backend materialises them
    assert w.shape == (1, 2, 5, 5)
    with pytest.raises(BackendUnsupportedError, match="backend 'sdpa' does not"):
        mha(x, need_weights=True, backend="sdpa")
    pinned = headlab.MultiHeadAttention(16, 2, backend="tiled")
    with pytest.raises(BackendUnsupportedError, match="backend 'tiled' does not"):
        pinned(x, need_weights=True)
    _, w = pinned(x, need_weights=True, backend="reference")  # the call's backend wins over the module's
    assert w is not None
    out_call, _ = pinned(x, backend="sdpa")
    out_mod, _ = pinned(x)
    torch.testing.assert_close(out_call, out_mod, atol=1e-6, rtol=1e-5)
