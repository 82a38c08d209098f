"""Attention on KIVI's codes, the bytes a per-head cache holds counted by a walk of its tensors, and a 16-bit cache
held in float16 or bfloat16 under a float32 model (issue 42, items 1 and 2).

The oracles are independent of the code under test: the keys and values a quantized head holds are KIVI's
quantize-dequantize written from the paper (``held_state`` of ``tests/test_kv_quant.py``), attention on them is a
float64 softmax written here, and the bytes are a walk of every tensor reachable from the cache's layers, each
storage counted once at its full size (what memory holds, not what a view shows).
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.test_kv_quant import compensation, held_state
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import headlab
from headlab import kv
from headlab.costs.kv import full_cache_bytes, policy_cache_bytes
from headlab.decode import HeadCache, quant_store
from headlab.decode.cache import HeadLayer
from headlab.decode.codes import attend_codes
from headlab.errors import ConfigError, ShapeError


# -- the oracles ---------------------------------------------------------------------------------------------
def walk_bytes(cache) -> int:
    """Bytes of every tensor reachable from the cache's layers (through attributes, lists, tuples, dicts), each
    storage once, at its size in memory."""
    seen_obj: set[int] = set()
    storages: dict[int, int] = {}

    def visit(x) -> None:
        if id(x) in seen_obj:
            return
        seen_obj.add(id(x))
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, list | tuple):
            for v in x:
                visit(v)
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            for name, v in vars(x).items():
                if name != "owner":  # the cache a layer reports to: walked from the top already
                    visit(v)

    for layer in cache.layers:
        visit(layer)
    return sum(storages.values())


def exact(rule, q, k_all, v_all, n, prefill, scale, softcap=None):
    """Float64 attention of ``q (H, d)`` (one decode query at position ``n - 1``) on what each kv head of ``rule``
    holds after ``n`` tokens (KIVI's values read back, independently), RazorAttention's token included (16-bit)."""
    H, hk = q.shape[0], k_all.shape[0]
    out = torch.zeros(H, v_all.shape[-1], dtype=torch.float64)
    for j in range(hk):
        kk, vv, held = held_state(rule, k_all[j], v_all[j], n, prefill)
        for h in range(j * (H // hk), (j + 1) * (H // hk)):
            s = (kk.double() @ q[h].double()) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            s, vals = s.masked_fill(~held, float("-inf")), vv.double()
            comp = compensation(rule, k_all[j], v_all[j], n - 1)
            if comp is not None:
                ck, cv, count = comp
                sc = (ck.double() @ q[h].double()) * scale
                sc = torch.tanh(sc / softcap) * softcap if softcap is not None else sc
                s, vals = torch.cat([s, (sc + math.log(count))[None]]), torch.cat([vals, cv.double()[None]])
            out[h] = torch.softmax(s, -1) @ vals
    return out


# shapes that break the grouping: lengths that are no multiple of the group, a window that cuts its first key group
# short, sinks, a full-precision tail, 2 kv heads each read by 3 query heads, groups of 32, 64 and 128; Gemma 2's
# soft-capping; a compensated window (16-bit: its store reads no codes, and the same function attends)
SLOW = pytest.mark.slow
CASES = [(kv.full(bits=4, group=32, residual=64), None), pytest.param(kv.full(bits=2, group=64, residual=128), 20.0,
                                                                      marks=SLOW),
         pytest.param(kv.full(bits=8, group=128, residual=128), None, marks=SLOW),
         pytest.param(kv.window(3, 100, bits=4, group=32, residual=32), None, marks=SLOW),
         (kv.window(0, 77, bits=2, group=32, residual=64), 20.0), (kv.window(2, 90, compensate=True), None),
         (kv.full(bits=4, group=64, residual=0), None), pytest.param(kv.window(3, 100, bits=4, group=32, residual=0),
                                                                     None, marks=SLOW)]


@pytest.mark.parametrize(("rule", "softcap"), CASES, ids=lambda x: x.text() if isinstance(x, kv.Rule) else str(x))
def test_attention_on_the_codes_equals_exact_attention_on_the_dequantized_cache(rule, softcap):
    torch.manual_seed(rule.bits + rule.group)
    N, d, prefill, scale = 230, 128, 171, 0.09
    k = torch.randn(1, 2, N, d) * torch.linspace(0.2, 4.0, d)  # channels of different ranges, as keys have
    v = torch.randn(1, 2, N, d)
    q = torch.randn(1, 6, N, d)
    layer = HeadLayer([rule, rule], n_heads=6)
    store = layer.groups[0]
    assert store.codes
    layer.update(k[:, :, :prefill], v[:, :, :prefill])[0].headlab_attend(None, q[:, :, :prefill], None, scaling=scale,
                                                                           softcap=softcap)
    used = 0
    for n in range(prefill + 1, N + 1):
        view = layer.update(k[:, :, n - 1 : n], v[:, :, n - 1 : n])[0]
        got = view.headlab_attend(None, q[:, :, n - 1 : n], None, scaling=scale, softcap=softcap)[0][0, 0]
        if n % 11 and n != N:  # a sample of the steps: the oracle is slow
            continue
        used += store.kq is not None and store.vq is not None
        want = exact(rule, q[0, :, n - 1], k[0], v[0], n, prefill, scale, softcap)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    if rule.bits == 16:
        assert used == 0 and store.comp_n > 0
        return
    assert used >= 5  # the steps compared did read quantized keys and values
    if isinstance(rule, kv.Window):  # the window did cut its first key group short
        kq = store.span["kq"]
        assert (kq.first - store.start) % rule.group != 0


def test_the_codes_path_reads_no_dequantized_copy_and_agrees_with_dequantize_then_attend():
    """The same decode through both paths of the store (a quantized window with RazorAttention's token); the codes
    path reads back no more than the token it evicts."""
    torch.manual_seed(1)
    rule = kv.window(4, 100, bits=4, group=32, residual=32, compensate=True)
    N, d = 170, 64
    k, v, q = torch.randn(1, 1, N, d), torch.randn(1, 1, N, d), torch.randn(1, 4, N, d)
    outs = []
    for codes in (True, False):
        layer = HeadLayer([rule], n_heads=4)
        layer.groups[0].codes = codes
        layer.update(k[:, :, :90], v[:, :, :90])[0].headlab_attend(None, q[:, :, :90], None, scaling=0.125)
        steps, rows = [], [0]  # the most tokens one call read back
        real = (quant_store.quant.dequantize_keys, quant_store.quant.dequantize_values)

        def counting(fn):
            def wrapped(codes, *a, **kw):
                rows.append(codes.shape[2])
                return fn(codes, *a, **kw)
            return wrapped

        quant_store.quant.dequantize_keys, quant_store.quant.dequantize_values = map(counting, real)
        try:
            for n in range(91, N + 1):
                view = layer.update(k[:, :, n - 1 : n], v[:, :, n - 1 : n])[0]
                steps.append(view.headlab_attend(None, q[:, :, n - 1 : n], None, scaling=0.125)[0])
        finally:
            quant_store.quant.dequantize_keys, quant_store.quant.dequantize_values = real
        # on the codes, only the one token a step evicts is read back (for RazorAttention's mean); else everything
        assert max(rows) == 1 if codes else max(rows) > 50
        outs.append(torch.cat(steps, 1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_attend_codes_refuses_what_it_cannot_read():
    q = torch.randn(1, 3, 1, 8)
    with pytest.raises(ShapeError, match="holds no key"):
        attend_codes(q, bits=4)
    with pytest.raises(ShapeError, match="do not divide"):
        attend_codes(q, keys_after=torch.randn(1, 2, 5, 8), values_after=torch.randn(1, 2, 5, 8), bits=4)
    with pytest.raises(ShapeError, match="4 values"):
        attend_codes(q, keys_after=torch.randn(1, 1, 5, 8), values_after=torch.randn(1, 1, 4, 8), bits=4)


# -- decoding a model ----------------------------------------------------------------------------------------
def _llama(head_dim: int = 32, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                      head_dim=head_dim, intermediate_size=64, attn_implementation="eager", max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval().to(dtype)


def _decode(model, ids, prefill, **options):
    """Teacher-forced decode through a HeadCache; checks the bytes against the walk at every step."""
    cache, out, held = HeadCache(model, options.pop("policy", None), **options), [], 0
    with torch.no_grad():
        out.append(model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits[0, -1:])
        for t in range(prefill, ids.shape[1]):
            out.append(model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits[0])
            held = cache.nbytes()
            assert held == walk_bytes(cache), t
    return torch.cat(out), cache, held


MIXED = kv.Policy.from_spec({(0, 0): kv.full(bits=4, group=32, residual=32), (0, 1): kv.window(2, 40, compensate=True),
                             (1, 0): kv.window(3, 50, bits=2, group=32, residual=32), (1, 1): kv.drop},
                            default="full")


def test_a_decode_on_the_codes_matches_dequantize_then_attend_and_every_byte_held_is_counted():
    model = _llama()
    ids = torch.randint(0, 61, (1, 120))
    codes, cache, held = _decode(model, ids, 90, policy=MIXED)
    plain, _, _ = _decode(model, ids, 90, policy=MIXED, codes=False)
    torch.testing.assert_close(codes, plain, rtol=1e-4, atol=1e-4)
    # the walk, the cache's count and the cost model agree (positions are held as integers, in no tensor)
    assert held == policy_cache_bytes(MIXED, kv_heads=[2, 2], tokens=120, head_dim=32)
    assert cache.layers[0].groups[0].positions()[0].tolist() == list(range(120))


def test_the_walk_sees_a_tensor_the_count_misses():
    """The check can fail: a tensor parked on a store is bytes the walk sees and ``nbytes`` does not."""
    model = _llama()
    _, cache, held = _decode(model, torch.randint(0, 61, (1, 40)), 30, policy=MIXED)
    cache.layers[0].groups[0].extra = torch.arange(40)
    assert walk_bytes(cache) == held + 40 * 8


@pytest.mark.parametrize("group", [pytest.param(32, marks=SLOW), 64, pytest.param(128, marks=SLOW)])
def test_the_group_size_is_an_option_and_the_bytes_follow_it(group):
    model = _llama(head_dim=128)
    policy = kv.Policy.parse(f"full:bits=4,group={group},residual=128")
    assert policy.default == kv.full(bits=4, group=group, residual=128)
    _, cache, held = _decode(model, torch.randint(0, 61, (1, 270)), 250, policy=policy)
    assert held == policy_cache_bytes(policy, kv_heads=[2, 2], tokens=270, head_dim=128)
    store = cache.layers[0].groups[0]
    assert store.ks.shape[2] == 256 // group and store.vs.shape[-1] == 128 // group  # 256 keys quantized


@pytest.mark.parametrize("group", [32, 64])
def test_with_no_residual_only_a_partial_key_group_waits_in_full_precision(group):
    """``residual=0``: every value quantized as it enters, keys once their group is whole (what optimum-quanto's
    cache does to a prompt); the bytes are the cost model's and fewer than with the default residual."""
    model = _llama(head_dim=128)
    policy = kv.Policy.parse(f"full:bits=4,group={group},residual=0")
    assert policy.default == kv.full(bits=4, group=group, residual=0)
    _, cache, held = _decode(model, torch.randint(0, 61, (1, 270)), 250, policy=policy)
    assert held == policy_cache_bytes(policy, kv_heads=[2, 2], tokens=270, head_dim=128)
    store = cache.layers[0].groups[0]
    assert store.vr is None and store.vq.shape[2] == 270  # every value quantized
    assert store.kr.shape[2] == 270 % group and store.kq.shape[2] == 270 // group * group
    default = kv.Policy.parse(f"full:bits=4,group={group}")
    _, _, held_default = _decode(model, torch.randint(0, 61, (1, 270)), 250, policy=default)
    assert held < held_default


@pytest.mark.parametrize("bad", ["64", 64.0, 0, True])
def test_a_group_that_is_not_a_positive_integer_is_refused(bad):
    with pytest.raises(ConfigError, match="group"):
        kv.full(bits=4, group=bad)


@pytest.mark.parametrize("dtype", [torch.float16, "bfloat16"])
def test_a_sixteen_bit_cache_is_held_under_a_float32_model(dtype):
    """The baseline of the ratios: the full cache held in 16 bits, counted by the same walk."""
    model = _llama()
    ids = torch.randint(0, 61, (1, 60))
    half, cache, held = _decode(model, ids, 45, dtype=dtype)
    full32, cache32, held32 = _decode(model, ids, 45)
    assert held == full_cache_bytes(layers=2, kv_heads=2, tokens=60, head_dim=32, dtype=dtype) == held32 // 2
    layer = cache.layers[0].groups[0]
    assert layer.keys.dtype == headlab.costs.model.parse_dtype(dtype)
    ref = DynamicCache(config=model.config)  # the keys the model computed, rounded to 16 bits
    with torch.no_grad():
        model(input_ids=ids, cache=ref, use_cache=True)
    torch.testing.assert_close(layer.keys, ref.layers[0].keys.to(layer.keys.dtype))  # to 16-bit rounding
    torch.testing.assert_close(half, full32, rtol=0.05, atol=0.05)  # 16-bit rounding of the keys and values only
    assert not torch.equal(half, full32)
    q4 = kv.Policy.uniform(kv.full(bits=4, group=32, residual=32))  # quantized heads take the storage dtype too
    _, c4, held4 = _decode(model, ids, 45, policy=q4, dtype=dtype)
    assert held4 == policy_cache_bytes(q4, kv_heads=[2, 2], tokens=60, head_dim=32, dtype=dtype)


def test_bad_storage_options_are_refused():
    model = _llama()
    with pytest.raises(ConfigError, match="unknown dtype"):
        HeadCache(model, dtype="int8")
    with pytest.raises(ConfigError, match="floating"):
        HeadCache(model, dtype=torch.int32)
    with pytest.raises(ConfigError, match="codes"):
        HeadCache(model, codes="yes")


@pytest.mark.parametrize("text", ["snapkv:16,window=4", "snapkv:16,window=4,bits=4,group=8,residual=0",
                                  pytest.param("adakv:16,window=4,bits=2,group=8,residual=8", marks=SLOW)])
def test_snapkv_counts_its_positions_and_the_walk_and_the_cost_model_agree(text):
    """A SnapKV / Ada-KV head's kept positions (int64, one per key) are held bytes: ``nbytes`` counts them, equal
    to the walk of the cache's tensors and to the cost model, at every step of a decode."""
    model = _llama()
    policy = kv.Policy.parse(text)
    _, cache, held = _decode(model, torch.randint(0, 61, (1, 40)), 30, policy=policy)  # the walk at every step
    kept = sum(p.numel() for layer in cache.layers for g in layer.groups for p in g.pos)
    assert kept == 2 * 2 * (16 + 10) and held == walk_bytes(cache)
    if not text.startswith("adakv"):  # Ada-KV's split among heads is the data's; the cost model's is even
        assert held == policy_cache_bytes(policy, kv_heads=[2, 2], tokens=40, head_dim=32, prompt=30)
