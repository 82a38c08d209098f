"""Precision per kv head (KIVI) and RazorAttention's compensation token in the per-head KV cache.

The oracles here are written from the published definitions, independently of headlab's code:

- KIVI (Liu et al. 2024): asymmetric min-max groups, ``scale = (max - min) / (2^b - 1)``, ``zero = min``,
  ``q = clamp(round((x - min) / scale))``, read back as ``q * scale + min``; keys per channel over groups
  of ``group`` tokens, quantized when the full-precision residual reaches ``residual`` tokens (so the
  keys below ``floor(n / R) * R`` are quantized; ``residual=0``, as optimum-quanto's cache holds a prompt:
  each group once it is whole); values per token over groups of ``group`` channels, all but the last
  ``residual`` quantized. A window quantizes what it holds past its sinks the same way,
  counted from the first non-sink position, and a key group takes its range from the tokens the window
  still held when the group was quantized.
- RazorAttention (Tang et al. 2024): a windowed head sees, besides its sinks and recent keys, one
  key/value pair, the mean of the keys and values it evicted, weighted in the softmax by their count.

The reference forward runs the model on transformers' own ``DynamicCache`` (full-precision keys as the
model computed them) with an attention function that reads them through this oracle.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import headlab
from headlab import kv
from headlab.costs.kv import full_cache_bytes, policy_cache_bytes, policy_peak_bytes
from headlab.decode import HeadCache, perplexity
from headlab.errors import ConfigError, ShapeError
from tests.architectures import build


# -- the oracle ---------------------------------------------------------------------------------------------
def qdq(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """Quantize then dequantize ``x`` with one asymmetric min-max group along ``dim``."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / (2 ** bits - 1)
    q = torch.round((x - lo) / torch.where(scale == 0, torch.ones_like(scale), scale)).clamp(0, 2 ** bits - 1)
    return q * scale + lo


def held_state(rule, k: torch.Tensor, v: torch.Tensor, n: int, prefill: int):
    """What a kv head under ``rule`` holds once ``n`` tokens are cached, after a ``prefill``-token prefill:
    ``(keys (n, d), values (n, d), held (n,) bool)`` read back in full precision (rows not held: garbage).
    ``k``, ``v``: ``(N >= n, d)`` the head's full-precision keys and values."""
    k, v = k[:n].clone(), v[:n].clone()
    pos = torch.arange(n)
    sink = rule.sink if isinstance(rule, kv.Window) else 0
    held = torch.ones(n, dtype=torch.bool)
    if isinstance(rule, kv.Window):
        held = (pos < sink) | (pos >= n - rule.recent)
    if rule.bits == 16:
        return k, v, held
    G, R, b = rule.group, rule.residual, rule.bits
    U = R or G  # keys leave the residual R at a time; with R = 0, each group once it is whole
    key_end = sink + (n - sink) // U * U if n > sink else n
    for g0 in range(sink, key_end, G):  # key groups, aligned at the first non-sink position
        end = g0 + G
        flushed = max(prefill, sink + math.ceil((end - sink) / U) * U)  # when this group left the residual
        first = max(g0, flushed - rule.recent) if isinstance(rule, kv.Window) else g0
        if first < end:
            k[first:end] = qdq(k[first:end], 0, b)  # per channel: the group's tokens
    for t in range(sink, max(sink, n - R)):  # values: per token, groups of G channels
        v[t] = qdq(v[t].reshape(-1, G), 1, b).reshape(-1)
    return k, v, held


def compensation(rule, k, v, t: int):
    """RazorAttention's token for a query at ``t``: ``(mean key, mean value, count)`` of what it evicted."""
    if not getattr(rule, "compensate", False):
        return None
    gone = slice(rule.sink, max(rule.sink, t - rule.recent + 1))
    count = gone.stop - gone.start
    if count <= 0:
        return None
    return k[gone].mean(0), v[gone].mean(0), count


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    policy, prefill = module._quant_test_policy, module._quant_test_prefill
    B, H, m, d = query.shape
    n = key.shape[2]
    rep = H // key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    cap = kwargs.get("softcap")
    out = torch.zeros(B, H, m, value.shape[-1])
    for h in range(H):
        rule = policy.rule(module.layer_idx, h // rep)
        if isinstance(rule, kv.Drop):
            continue
        kr, vr = key[0, h // rep], value[0, h // rep]
        for i in range(m):
            t = n - m + i
            if m == 1:  # a decode step reads the cache as it is after this token entered it
                kk, vv, held = held_state(rule, kr, vr, n, prefill)
            else:  # the prompt's own attention is in full precision (KIVI)
                kk, vv, held = kr, vr, torch.ones(n, dtype=torch.bool)
            vis = held & (torch.arange(n) <= t)
            if isinstance(rule, kv.Window):
                j = torch.arange(n)
                vis &= (j < rule.sink) | (t - j < rule.recent)
            if attention_mask is not None:
                mk = attention_mask[0, 0, i]
                vis &= mk if mk.dtype == torch.bool else mk > torch.finfo(mk.dtype).min / 2
            s = (kk @ query[0, h, i]) * scale
            if cap is not None:
                s = torch.tanh(s / cap) * cap
            keys_s, vals = s.masked_fill(~vis, float("-inf")), vv
            comp = compensation(rule, kr, vr, t)
            if comp is not None:
                ck, cv, count = comp
                sc = (ck @ query[0, h, i]) * scale
                if cap is not None:
                    sc = torch.tanh(sc / cap) * cap
                keys_s = torch.cat([keys_s, (sc + math.log(count))[None]])
                vals = torch.cat([vv, cv[None]])
            out[0, h, i] = torch.softmax(keys_s, -1) @ vals
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("kv_quant_reference", _reference_attention)
AttentionMaskInterface.register("kv_quant_reference", sdpa_mask)


def _reference_logits(model, ids, policy, prefill: int):
    """Teacher-forced decode on a DynamicCache through the oracle: one prefill, then a token at a time."""
    for mod in model.modules():
        if hasattr(mod, "layer_idx"):
            mod._quant_test_policy, mod._quant_test_prefill = policy, prefill
    saved = model.config._attn_implementation
    model.set_attn_implementation("kv_quant_reference")
    try:
        cache, out = DynamicCache(), []  # no sliding layers: the oracle masks
        with torch.no_grad():
            out.append(model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits[0])
            for t in range(prefill, ids.shape[1]):
                out.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0])
        return torch.cat(out)
    finally:
        model.set_attn_implementation(saved)


def _decoded(model, ids, policy, prefill: int, *, check_bytes: bool = True):
    cache, out = HeadCache(model, policy), []
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    head_dim = getattr(model.config, "head_dim", None) or head_dim
    kvh = [model.config.num_key_value_heads] * model.config.num_hidden_layers
    with torch.no_grad():
        out.append(model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits[0])
        for t in range(prefill, ids.shape[1]):
            if check_bytes:  # the bytes held, scales included, are the cost model's at every length
                assert cache.nbytes() == policy_cache_bytes(policy, kv_heads=kvh, tokens=t, head_dim=head_dim)
            out.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0])
    return torch.cat(out), cache


def _mixed(layers: int = 2):
    """Every kind of head: 16-bit full, quantized full at 8/4/2 bits, quantized windows (sinks, partial key
    groups), a compensated window, a dropped head."""
    spec = {(0, 0): kv.full(bits=4, group=4, residual=8), (0, 1): kv.window(2, 6, compensate=True),
            (1, 0): kv.window(1, 12, bits=2, group=4, residual=8), (1, 1): kv.full(bits=8, group=2, residual=4)}
    return kv.Policy.from_spec(spec, default="full")


# -- (a) the quantizer against the published scheme ---------------------------------------------------------
@pytest.mark.parametrize("rule", [kv.full(bits=4, group=4, residual=8), kv.full(bits=2, group=8, residual=8),
                                  kv.full(bits=8, group=4, residual=8), kv.window(3, 13, bits=4, group=4, residual=8),
                                  kv.window(2, 5, bits=2, group=4, residual=4),
                                  kv.window(0, 9, bits=8, group=4, residual=4), kv.full(bits=4, group=4, residual=0),
                                  kv.window(3, 13, bits=2, group=4, residual=0)])
@pytest.mark.parametrize("prefill", [1, 11, 30])
def test_held_keys_and_values_equal_kivis_quantize_dequantize(rule, prefill):
    """A layer fed random keys (with an outlier channel, as real keys have) holds, read back, KIVI's values."""
    from headlab.decode.cache import HeadLayer

    torch.manual_seed(prefill)
    N, d = 40, 8
    k = torch.randn(1, 1, N, d) * torch.tensor([1, 1, 8, 1, 1, 1, 1, 0.1])  # channel 2: an outlier channel
    v = torch.randn(1, 1, N, d)
    layer = HeadLayer([rule], n_heads=2)
    q = torch.randn(1, 2, N, d)
    group = layer.groups[0]
    layer.update(k[:, :, :prefill], v[:, :, :prefill])[0].headlab_attend(None, q[:, :, :prefill], None, scaling=0.3)
    for n in range(prefill, N + 1):
        if n > prefill:
            view = layer.update(k[:, :, n - 1:n], v[:, :, n - 1:n])[0]
            view.headlab_attend(None, q[:, :, n - 1:n], None, scaling=0.3)
        got_k, got_v, pos, _ = group.held()
        want_k, want_v, held = held_state(rule, k[0, 0], v[0, 0], n, prefill)
        assert pos.tolist() == held.nonzero().squeeze(1).tolist()
        torch.testing.assert_close(got_k[0, 0], want_k[held], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_v[0, 0], want_v[held], rtol=1e-6, atol=1e-6)
    # and the test can fail: the keys below the boundary are not the full-precision ones
    quantized = ~torch.isclose(want_k[held], k[0, 0, :N][held]).all(-1)
    assert bool(quantized.any())


def test_the_codes_are_packed_and_the_scales_are_per_group():
    from headlab.decode.quant import dequantize_values, pack, quantize_keys, quantize_values, unpack

    codes = torch.randint(0, 4, (3, 16), dtype=torch.uint8)
    assert pack(codes, 2).shape == (3, 4) and pack(codes, 2).dtype == torch.uint8
    assert torch.equal(unpack(pack(codes, 2), 2), codes)
    assert torch.equal(unpack(pack(codes, 4), 4), codes) and pack(codes, 4).shape == (3, 8)
    x = torch.randn(1, 2, 8, 16)
    c, s, z = quantize_keys(x, 4, group=4)
    assert c.shape == (1, 2, 8, 8) and s.shape == z.shape == (1, 2, 2, 16)
    c, s, z = quantize_values(x, 2, group=8)
    assert c.shape == (1, 2, 8, 4) and s.shape == (1, 2, 8, 2)
    want = qdq(x.reshape(1, 2, 8, 2, 8), 4, 2).reshape(x.shape)
    torch.testing.assert_close(dequantize_values(c, s, z, bits=2), want, rtol=1e-6, atol=1e-6)


# -- (b) decoding equals an eager forward over the dequantized cache ----------------------------------------
@pytest.mark.parametrize("family", ["llama", "gemma2", "mistral"])
@pytest.mark.parametrize("prefill", [7, 20])
def test_decoding_under_a_quantized_policy_equals_a_forward_over_the_dequantized_cache(family, prefill):
    """Gemma 2 brings soft-capping and its own sliding window, Mistral its own window (intersected)."""
    model = build(family)
    ids = torch.randint(3, 97, (1, 36), generator=torch.Generator().manual_seed(prefill))
    policy = _mixed()
    want = _reference_logits(model, ids, policy, prefill)
    got, _ = _decoded(model, ids, policy, prefill)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        plain = model(input_ids=ids).logits[0]
    assert (got - plain).abs().max() > 1e-3  # quantization and eviction do change the logits


def test_the_compensation_token_is_the_weighted_mean_of_the_evicted_keys():
    """In one forward (the prompt), in decode steps, and with the count's weight: the token matters."""
    model = build("llama")
    ids = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    comp = kv.Policy.uniform(kv.window(2, 5, compensate=True))
    want = _reference_logits(model, ids, comp, 30)  # the whole text as a prefill: per-query compensation
    got, _ = _decoded(model, ids, comp, 30)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    got, cache = _decoded(model, ids, comp, 4)
    torch.testing.assert_close(got, _reference_logits(model, ids, comp, 4), rtol=1e-4, atol=1e-4)
    assert cache.layers[0].groups[0].comp_n == 30 - 2 - 5 and cache.nbytes() == 2 * 2 * (2 + 5 + 1) * 2 * 8 * 4
    plain, _ = _decoded(model, ids, kv.Policy.uniform(kv.window(2, 5)), 4)
    assert (got - plain)[8:].abs().max() > 1e-3
    assert perplexity(model, ids, policy=comp) != perplexity(model, ids,
                                                                             policy=kv.Policy.uniform(kv.window(2, 5)))


def test_sixteen_bit_heads_beside_quantized_ones_are_the_plain_cache():
    """A 16-bit head's keys are held as the model computed them, whatever its neighbours hold."""
    model = build("llama")
    ids = torch.randint(3, 97, (1, 24), generator=torch.Generator().manual_seed(5))
    policy = kv.Policy.from_spec({(0, 0): kv.full(bits=2, group=4, residual=4)})
    _, cache = _decoded(model, ids, policy, 6)
    dyn = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, cache=dyn, use_cache=True)
    plain = next(g for g in cache.layers[0].groups if g.rule == kv.full)  # layer 0's kv head 1
    torch.testing.assert_close(plain.keys, dyn.layers[0].keys[:, 1:2], rtol=1e-6, atol=1e-6)
    quantized = next(g for g in cache.layers[0].groups if g.rule != kv.full)
    assert quantized.nbytes() < plain.nbytes()  # small groups in float32: the scales cost as much as the codes


# -- (c) bytes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [
    kv.Policy.uniform(kv.full(bits=8, group=4, residual=8)), kv.Policy.uniform(kv.full(bits=4, group=4, residual=8)),
    kv.Policy.uniform(kv.full(bits=2, group=8, residual=16)),
    kv.Policy.uniform(kv.window(2, 9, bits=4, group=2, residual=4, compensate=True)), _mixed(),
    kv.Policy.from_spec({(0, 0): kv.window(1, 4, bits=2, group=4, residual=4), (1, 1): kv.drop},
                        default=kv.full(bits=4, group=8, residual=8))])
def test_bytes_held_equal_the_prediction(policy):
    model = build("llama")
    prompt = torch.randint(3, 97, (1, 21), generator=torch.Generator().manual_seed(4))
    g = headlab.generate(model, prompt, policy=policy, max_new_tokens=14, stop_at_eos=False)
    held = 21 + g.ids.shape[1] - 1
    assert g.kv_bytes == policy_peak_bytes(policy, kv_heads=[2, 2], prompt=21, tokens=held, head_dim=8)
    assert g.kv_bytes < g.kv_bytes_full == full_cache_bytes(layers=2, kv_heads=2, tokens=held, head_dim=8)
    cache = HeadCache(model, policy)
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=14, do_sample=False, cache=cache, min_new_tokens=14)
    assert cache.nbytes() == policy_cache_bytes(policy, kv_heads=[2, 2], tokens=held, head_dim=8)
    assert cache.peak_bytes == g.kv_bytes


def test_the_cost_model_counts_codes_scales_and_zero_points():
    """By hand: SmolLM2's shape (30 layers x 3 kv heads x head dim 64) at 8,192 tokens in float16."""
    shape = dict(kv_heads=[3] * 30, tokens=8192, head_dim=64, dtype="float16")
    full16 = policy_cache_bytes(kv.Policy.uniform("full"), **shape)
    assert full16 == full_cache_bytes(layers=30, kv_heads=3, tokens=8192, head_dim=64, dtype="float16")
    # 4 bits, groups of 32, residual 128: keys 8,192 quantized (8192 % 128 = 0), values 8,064 and 128 in fp16
    keys = 8192 * 64 // 2 + 2 * (8192 // 32) * 64 * 2
    values = 8064 * 64 // 2 + 2 * 8064 * (64 // 32) * 2 + 128 * 64 * 2
    assert policy_cache_bytes(kv.Policy.parse("full:bits=4"), **shape) == 90 * (keys + values)
    assert policy_cache_bytes(kv.Policy.parse("full:bits=4"), **shape) < 0.33 * full16
    assert policy_cache_bytes(kv.Policy.parse("full:bits=2"), **shape) < 0.2 * full16
    # a window's bytes: 4 sinks in fp16, its 256 recent past the residual quantized, partial first key group
    w = kv.window(4, 256, bits=4)
    lay = w.layout(8192)
    assert (lay.quant_keys, lay.quant_values) == (8068 - 7936, 8064 - 7936)
    assert policy_cache_bytes(kv.Policy.parse("streaming:4,256,bits=4,compensate"), **shape) == \
        policy_cache_bytes(kv.Policy.uniform(w), **shape) + 90 * 2 * 64 * 2


# -- text, files and refusals ------------------------------------------------------------------------------
def test_policy_text_and_json_take_the_precision(tmp_path):
    assert kv.Policy.parse("full:bits=4").default == kv.full(bits=4) == kv.full(4, group=32, residual=128)
    assert kv.Policy.parse("streaming:4,256,bits=2").default == kv.window(4, 256, bits=2)
    assert kv.Policy.parse("window:4,256,bits=4,group=16,residual=64,compensate").default == \
        kv.window(4, 256, bits=4, group=16, residual=64, compensate=True)
    assert kv.Policy.parse("streaming:4,256,compensate=false").default == kv.window(4, 256)
    assert kv.Policy.uniform(kv.window(4, 256, bits=2, compensate=True)).name == "streaming 4+256 2-bit compensated"
    p = _mixed()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p.to_json()))
    assert kv.Policy.load(path).rules == p.rules
    assert p.bits([2, 2]) == {16: 1, 8: 1, 4: 1, 2: 1} and p.counts([2, 2]) == {"full": 2, "window": 2, "drop": 0}


def test_a_head_split_takes_a_precision_for_both_sides():
    model = build("llama")
    scores = torch.tensor([[0.0, 0.9, 0.1, 0.2], [0.3, 0.0, 0.0, 0.05]])
    p = kv.Policy.from_scores(model, scores, keep=0.25, rest=kv.window(2, 4, bits=2, group=4, residual=4),
                              kept=kv.full(bits=4, group=4, residual=4))
    assert p.rule(0, 0) == kv.full(bits=4, group=4, residual=4)
    assert p.bits([2, 2]) == {16: 0, 8: 0, 4: 1, 2: 3} and p.counts([2, 2]) == {"full": 1, "window": 3, "drop": 0}
    g = headlab.generate(model, torch.randint(3, 97, (1, 20), generator=torch.Generator().manual_seed(0)),
                         policy=p, max_new_tokens=5, stop_at_eos=False)
    assert g.kv_bytes < g.kv_bytes_full / 2


@pytest.mark.parametrize("make, words", [
    (lambda: kv.full(bits=3), "8, 4 or 2 bits"),
    (lambda: kv.window(4, 256, bits=1), "8, 4 or 2 bits"),
    (lambda: kv.full(bits=4, group=0), "group=0"),
    (lambda: kv.full(bits=4, group=32, residual=100), "multiple of group"),
    (lambda: kv.full(bits=16, group=8), "bits=8, 4"),
    (lambda: kv.window(4, 8, compensate="yes"), "True or False"),
    (lambda: kv.Policy.parse("full:bits=3"), "8, 4 or 2 bits"),
    (lambda: kv.Policy.parse("full:bits=four"), "integer"),
    (lambda: kv.Policy.parse("full:compensate"), "unknown option"),
    (lambda: kv.Policy.parse("streaming:4,256,colour=2"), "unknown option"),
    (lambda: kv.Policy.parse("streaming:bits=4,4,256"), "SINK,RECENT"),
    (lambda: kv.Policy.parse("drop:bits=4"), "unknown kv rule"),
])
def test_bad_precisions_are_refused(make, words):
    with pytest.raises(ConfigError, match=words):
        make()


def test_groups_that_do_not_fit_the_head_dimension_are_refused_before_decoding():
    model = build("llama")  # head dim 8
    with pytest.raises(ConfigError, match="does not divide the head dimension 8"):
        HeadCache(model, kv.Policy.uniform(kv.full(bits=4, group=3, residual=6)))
    with pytest.raises(ConfigError, match="does not divide"):
        headlab.generate(model, torch.tensor([[5, 6, 7]]), policy=kv.Policy.uniform(kv.full(bits=4)))  # group 32
    with pytest.raises(ConfigError, match="does not divide"):
        policy_cache_bytes(kv.Policy.parse("full:bits=4"), kv_heads=[2], tokens=10, head_dim=48)


def test_a_batch_through_the_cache_is_refused():
    model = build("llama")
    with pytest.raises(ShapeError, match="one sequence"):
        with torch.no_grad():
            model(input_ids=torch.randint(3, 97, (2, 5)), cache=HeadCache(model), use_cache=True)


@pytest.mark.parametrize("scores, words", [
    (torch.rand(2, 5), "do not fit"), (torch.rand(3, 4), "do not fit"), (torch.rand(8), "do not fit"),
    (torch.tensor([[0.1, float("nan"), 0.3, 0.4], [0.1] * 4]), "NaN"), ("abc", "numbers"),
])
def test_scores_of_the_wrong_shape_or_with_nan_are_refused(scores, words):
    with pytest.raises(ConfigError, match=words):
        kv.Policy.from_scores(build("llama"), scores, keep=0.5)


def test_a_quantized_perplexity_needs_decoding_to_see_the_quantization():
    model = build("llama")
    ids = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(8))
    q = kv.Policy.uniform(kv.full(bits=2, group=4, residual=4))
    one = perplexity(model, ids)
    assert perplexity(model, ids, policy=q) == pytest.approx(one, rel=1e-5)  # the prefill is full precision
    logits, _ = _decoded(model, ids, q, 5, check_bytes=False)
    want = torch.exp(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]))
    assert perplexity(model, ids, policy=q, prefill=5) == pytest.approx(float(want), rel=1e-5)
    assert perplexity(model, ids, policy=q, prefill=5) != pytest.approx(one, rel=1e-4)
