"""Eviction times quantization (issue 42, item 3): SnapKV and Ada-KV heads that store what they keep as KIVI's codes.

The oracles: the kept set is the 16-bit rule's (the selection runs on the prompt in full precision); a decode step
equals a float64 softmax over the head's held tokens read back by an independent quantize-dequantize of that
sequence (``tests.test_kv_quant.held_state``, written from KIVI's definition); every byte held is counted (the walk of
``tests.test_kv_codes``), and equals the cost model's layout of each head's count.
"""

from __future__ import annotations

import pytest
import torch
from tests.test_kv_codes import _llama, exact, walk_bytes
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from headlab import kv
from headlab.costs.kv import layout_bytes, policy_cache_bytes
from headlab.decode import HeadCache
from headlab.decode.cache import HeadLayer
from headlab.errors import ConfigError

CASES = [kv.snap(80, window=8, pool=3, bits=4, group=32, residual=32),
         kv.adakv(total=150, window=8, pool=1, bits=2, group=32, residual=64)]


@pytest.mark.parametrize("rule", CASES, ids=lambda r: r.text())
def test_a_quantized_snap_head_attends_on_the_codes_of_what_it_kept(rule):
    torch.manual_seed(rule.bits)
    N, d, prefill, scale = 190, 64, 140, 0.11
    k = torch.randn(1, 2, N, d) * torch.linspace(0.2, 4.0, d)
    v, q = torch.randn(1, 2, N, d), torch.randn(1, 6, N, d)
    plain = rule.__class__(**{**rule.__dict__, "bits": 16})  # the same selection at 16 bits
    layers = {r.bits: HeadLayer([r, r], n_heads=6) for r in (rule, plain)}
    for layer in layers.values():
        layer.update(k[:, :, :prefill], v[:, :, :prefill])[0].headlab_attend(None, q[:, :, :prefill], None,
                                                                               scaling=scale, softcap=None)
    store = layers[rule.bits].groups[0]
    kept = [p.tolist() for p in store.pos]
    assert kept == [p.tolist() for p in layers[16].groups[0].pos]  # the selection does not see the bits
    assert 0 < len(kept[0]) < prefill and (not rule.adaptive or len(kept[0]) != len(kept[1]))
    seq = full = kv.full(bits=rule.bits, group=rule.group, residual=rule.residual)
    used = 0
    for n in range(prefill + 1, N + 1):
        got = {}
        for bits, layer in layers.items():
            view = layer.update(k[:, :, n - 1 : n], v[:, :, n - 1 : n])[0]
            got[bits] = view.headlab_attend(None, q[:, :, n - 1 : n], None, scaling=scale, softcap=None)[0][0, 0]
        if n % 9 and n != N:
            continue
        held = [torch.tensor(p + list(range(prefill, n))) for p in kept]
        want = torch.zeros(6, d, dtype=torch.float64)
        for j in range(2):  # each kv head: the softmax over its held sequence, quantized as KIVI quantizes a sequence
            one = exact(seq, q[0, 3 * j : 3 * j + 3, n - 1], k[0, j : j + 1, held[j]], v[0, j : j + 1, held[j]],
                        len(held[j]), len(kept[j]), scale)
            want[3 * j : 3 * j + 3] = one
        torch.testing.assert_close(got[rule.bits].double(), want, rtol=1e-5, atol=1e-5)
        used += all(s.kq is not None and s.vq is not None for s in store.quant)
        assert store.nbytes() == sum(layout_bytes(rule.held_layout(len(h)), head_dim=d) for h in held)
    assert used >= 3 and full.bits == rule.bits


def _decode(model, ids, prompt, policy, **options):
    cache, out = HeadCache(model, policy, **options), []
    with torch.no_grad():
        out.append(model(input_ids=ids[:, :prompt], cache=cache, use_cache=True).logits[0, -1:])
        for t in range(prompt, ids.shape[1]):
            out.append(model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits[0])
            assert walk_bytes(cache) == cache.nbytes()  # every tensor, the int64 positions each head kept included
    return torch.cat(out), cache


@pytest.mark.parametrize("text", ["snapkv:40,window=8,pool=3,bits=4,group=32,residual=32",
                                  pytest.param("adakv:total=90,window=8,bits=2,group=32,residual=32",
                                               marks=pytest.mark.slow)])
def test_a_decode_under_quantized_snapkv_reads_the_codes_and_holds_what_the_cost_model_says(text):
    model = _llama()
    policy = kv.Policy.parse(text)
    ids = torch.randint(0, 61, (1, 132))
    codes, cache = _decode(model, ids, 100, policy)
    readback, _ = _decode(model, ids, 100, policy, codes=False)
    torch.testing.assert_close(codes, readback, rtol=1e-4, atol=1e-4)
    sixteen, plain = _decode(model, ids, 100, kv.Policy.parse(text.split(",bits")[0]))
    assert [cache.positions(1, j).tolist() for j in range(2)] == [plain.positions(1, j).tolist() for j in range(2)]
    rule = policy.rule(0, 0)
    counts = [len(cache.positions(l, j)) for l in range(2) for j in range(2)]
    assert cache.nbytes() == sum(layout_bytes(rule.held_layout(c), head_dim=32) for c in counts)
    if not rule.adaptive:
        assert cache.nbytes() == policy_cache_bytes(policy, kv_heads=[2, 2], tokens=132, head_dim=32, prompt=100)
    assert cache.nbytes() < 0.45 * plain.nbytes()
    assert (codes.argmax(-1) == sixteen.argmax(-1)).float().mean() > 0.8  # close to the 16-bit selection's tokens


def test_quantized_snap_text_round_trips_and_bad_precision_is_refused():
    r = kv.Policy.parse("snapkv:256,bits=4,group=64,residual=128").rule(0, 0)
    assert (r.bits, r.group, r.residual) == (4, 64, 128) and r.label() == "SnapKV 256 4-bit"
    assert kv.as_rule(r.text()) == r and kv.as_rule(kv.adakv(64, bits=2).text()) == kv.adakv(64, bits=2)
    for bad in ("snapkv:256,bits=3", "snapkv:256,group=32", "adakv:64,bits=4,group=32,residual=48"):
        with pytest.raises(ConfigError):
            kv.Policy.parse(bad)


# -- Expected Attention: the query-agnostic scorer --------------------------------------------------------------
def expected_kept(model, ids, rule) -> list[list[list[int]]]:
    """kvpress's ExpectedAttentionPress, written from its definition: the queries before their rotary embedding
    (q_proj's outputs, hooked), their mean and covariance past the sinks, the rotation averaged over the next
    ``future`` positions (R_t = cos_t I + sin_t P from the model's rotary module), the keys and values of a
    DynamicCache; per kv head the sinks and the ``budget - sink`` best."""
    cfg = model.config
    H, Hk, n = cfg.num_attention_heads, cfg.num_key_value_heads, ids.shape[1]
    d = cfg.hidden_size // H
    qs: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, i, o, l=l: qs.__setitem__(l, o))
             for l, layer in enumerate(model.model.layers)]
    model.set_attn_implementation("eager")
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    for h in hooks:
        h.remove()
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(n, n + rule.future)[None])
    P = torch.zeros(d, d)
    P[d // 2:, :d // 2], P[:d // 2, d // 2:] = torch.eye(d // 2), -torch.eye(d // 2)
    R = (cos[0].unsqueeze(1) * torch.eye(d) + sin[0].unsqueeze(1) * P).mean(0).double()
    out = []
    for l in range(cfg.num_hidden_layers):
        q = qs[l][0].view(n, H, d).transpose(0, 1)[:, rule.sink:].double()  # (H, n - sink, d), before RoPE
        k, v = cache.layers[l].keys[0, :, rule.sink:].double(), cache.layers[l].values[0, :, rule.sink:].double()
        mu = q.mean(1) @ R.T
        c = q - q.mean(1, keepdim=True)
        cov = R @ (c.transpose(1, 2) @ c / c.shape[1]) @ R.T
        kept = []
        for j in range(Hk):
            a = 0
            for h in range(j * H // Hk, (j + 1) * H // Hk):
                s = k[j] @ mu[h] / d ** 0.5 + ((k[j] @ cov[h]) * k[j]).sum(-1) / d / 2
                a = a + torch.softmax(s, -1) / (H // Hk)
            a = a * v[j].norm(dim=-1)
            top = torch.topk(a, rule.budget - rule.sink).indices + rule.sink
            kept.append(list(range(rule.sink)) + sorted(top.tolist()))
        out.append(kept)
    return out


def test_expected_attention_keeps_what_future_queries_are_expected_to_attend_to():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
                                         num_key_value_heads=2, intermediate_size=64, rope_theta=100.0,
                                         attn_implementation="eager")).eval()
    ids = torch.randint(0, 61, (1, 80))
    rule = kv.expected(24, sink=3, future=64)
    want = expected_kept(model, ids, rule)
    cache = HeadCache(model, kv.Policy.uniform(rule))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    assert [[cache.positions(l, j).tolist() for j in range(2)] for l in range(2)] == want
    assert want[0][0] != want[0][1]  # per head
    # on 4-bit storage: the same selection, a decode on the codes, the bytes the cost model predicts
    q4 = kv.Policy.parse("expected:24,sink=3,future=64,bits=4,group=8,residual=8")
    more = torch.randint(0, 61, (1, 92))
    more[:, :80] = ids
    codes, c4 = _decode(model, more, 80, q4)
    readback, _ = _decode(model, more, 80, q4, codes=False)
    torch.testing.assert_close(codes, readback, rtol=1e-4, atol=1e-4)
    assert c4.positions(1, 1).tolist()[:24] == want[1][1]
    assert c4.nbytes() == policy_cache_bytes(q4, kv_heads=[2, 2], tokens=92, head_dim=16, prompt=80)


def test_expected_attention_text_and_refusals():
    r = kv.as_rule("expected:256,sink=4,covariance=0")
    assert r == kv.expected(256, covariance=False) and kv.as_rule(r.text()) == r and r.label().startswith("Expected")
    for bad in ("expected:4,sink=4", "expected", "expected:64,window=8", "expected:64,future=0"):
        with pytest.raises(ConfigError):
            kv.Policy.parse(bad)
