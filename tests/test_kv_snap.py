"""Token-level budgets per kv head: SnapKV's selection (Li et al. 2024) and Ada-KV's head-wise budgets (Feng et al.
2024) in the per-head KV cache.

The oracles here are written from the published definitions, independently of headlab's code:

- SnapKV: after the prefill of ``n`` prompt tokens, a head's score of prompt key ``j < n - w`` is the attention the
  last ``w`` prompt queries (the observation window) give it, summed over those rows (each row's softmax over every
  key it sees: the model's own eager attention maps), then pooled along the positions by a 1-D max (or average)
  pool of width ``pool``, padded, stride 1. A grouped-query kv head takes the mean of its query heads' pooled scores.
  The head keeps the ``budget - w`` best keys (ties: the earlier position) and the window.
- Ada-KV: the heads of a layer keep ``total`` prompt tokens together: each its window and its own best
  ``floor - w``, then the best of the remaining scores over all the heads jointly (ties: the lower head, then the
  earlier position), up to the total.

After the selection every later token is appended to every head, so a forward in which each head sees exactly its
kept prompt tokens plus the tokens after the prompt (causal) is the reference for decoding.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import headlab
from headlab import kv
from headlab.costs.kv import full_cache_bytes, policy_cache_bytes, policy_peak_bytes
from headlab.decode import HeadCache, perplexity
from headlab.decode.cache import HeadLayer
from headlab.errors import ConfigError, InputError
from tests.architectures import build

KVH = [2, 2]  # the tiny models: 2 layers, 4 query heads, 2 kv heads, head dim 8


# -- the oracle ---------------------------------------------------------------------------------------------
def _pooled(votes: list[float], pool: int, pooling: str) -> list[float]:
    r = pool // 2
    if pooling == "max":
        return [max(votes[max(0, c - r):c + r + 1]) for c in range(len(votes))]
    return [sum(votes[max(0, c - r):c + r + 1]) / pool for c in range(len(votes))]  # zero padding counted


def snapkv_scores(maps: torch.Tensor, kv_heads: int, window: int, pool: int, pooling: str) -> list[list[float]]:
    """``maps (H, n, n)``: one layer's eager attention; returns per kv head the score of each key ``j < n - w``."""
    H, n, _ = maps.shape
    rep, L = H // kv_heads, n - window
    out = []
    for j in range(kv_heads):
        per_head = []
        for h in range(j * rep, (j + 1) * rep):
            votes = [float(maps[h, n - window:, c].double().sum()) for c in range(L)]
            per_head.append(_pooled(votes, pool, pooling))
        out.append([sum(p[c] for p in per_head) / rep for c in range(L)])
    return out


def snapkv_kept(maps, kv_heads: int, rule) -> list[list[int]]:
    """The prompt positions each kv head keeps under ``rule`` (a kv.snap or kv.adakv), from the definitions."""
    n, w = maps.shape[-1], rule.window
    scores = snapkv_scores(maps, kv_heads, w, rule.pool, rule.pooling)
    window = list(range(n - w, n))
    if not rule.adaptive:
        if rule.budget >= n:
            return [list(range(n))] * kv_heads
        return [sorted(sorted(range(n - w), key=lambda c: (-s[c], c))[:rule.budget - w]) + window for s in scores]
    total = rule.total if rule.total is not None else rule.budget * kv_heads
    if total >= kv_heads * n:
        return [list(range(n))] * kv_heads
    floor = rule.floor if rule.floor is not None else w + (total // kv_heads - w) // 5
    chosen = [set(sorted(range(n - w), key=lambda c: (-s[c], c))[:floor - w]) for s in scores]
    rest = total - sum(len(c) + w for c in chosen)
    cands = sorted(((-scores[h][c], h, c) for h in range(kv_heads) for c in range(n - w) if c not in chosen[h]))
    for _, h, c in cands[:rest]:
        chosen[h].add(c)
    return [sorted(c) + window for c in chosen]


def eager_maps(model, ids) -> list[torch.Tensor]:
    model.set_attn_implementation("eager")
    with torch.no_grad():
        return [a[0] for a in model(input_ids=ids, output_attentions=True).attentions]


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Each head sees its kept prompt tokens and every token after the prompt (causal); the prompt's rows: causal."""
    kept, prompt = module._snap_kept, module._snap_prompt
    B, H, n, d = query.shape
    rep = H // key.shape[1]
    k, v = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    s = (query @ k.transpose(-1, -2)) * (scaling if scaling is not None else d ** -0.5)
    if kwargs.get("softcap") is not None:
        s = torch.tanh(s / kwargs["softcap"]) * kwargs["softcap"]
    t, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    vis = torch.zeros(H, n, n, dtype=torch.bool)
    for h in range(H):
        held = torch.zeros(n, dtype=torch.bool)
        held[kept[module.layer_idx][h // rep]] = True
        held[prompt:] = True
        vis[h] = (j <= t) & ((t < prompt) | held[None, :])
    if attention_mask is not None:
        m = attention_mask if attention_mask.dtype == torch.bool else attention_mask > torch.finfo(s.dtype).min / 2
        vis = vis & m
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2).contiguous(), None


AttentionInterface.register("kv_snap_reference", _reference_attention)
AttentionMaskInterface.register("kv_snap_reference", sdpa_mask)


def _reference_logits(model, ids, kept, prompt: int):
    for mod in model.modules():
        if hasattr(mod, "layer_idx"):
            mod._snap_kept, mod._snap_prompt = kept, prompt
    model.set_attn_implementation("kv_snap_reference")
    with torch.no_grad():
        return model(input_ids=ids).logits[0]


def _decoded(model, ids, policy, prompt: int, chunk: int = 0):
    """Prefill ``prompt`` tokens, then a ``chunk`` of tokens at once (a question), then one token at a time; checks
    the bytes against the cost model at every length."""
    cache, out = HeadCache(model, policy), []
    with torch.no_grad():
        out.append(model(input_ids=ids[:, :prompt], cache=cache, use_cache=True).logits[0])
        t = prompt
        if chunk:
            out.append(model(input_ids=ids[:, t:t + chunk], cache=cache, use_cache=True).logits[0])
            t += chunk
        for t in range(t, ids.shape[1]):
            assert cache.nbytes() == policy_cache_bytes(policy, kv_heads=KVH, tokens=t, head_dim=8, prompt=prompt)
            out.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0])
    return torch.cat(out), cache


RULES = [kv.snap(12, window=4, pool=3), kv.snap(10, window=5, pool=5, pooling="avg"), kv.snap(7, window=7, pool=1),
         kv.adakv(12, window=4, pool=3), kv.adakv(total=20, floor=6, window=4, pool=1),
         kv.adakv(total=30, window=3, pool=5, pooling="avg")]


# -- (a) the kept set is SnapKV's / Ada-KV's selection --------------------------------------------------------
@pytest.mark.parametrize("rule", RULES, ids=repr)
@pytest.mark.parametrize("family", ["llama", "gemma2", "mistral"])
def test_each_head_keeps_the_tokens_its_observation_window_attends_to(family, rule):
    """Gemma 2 brings soft-capping and a sliding window of its own, Mistral its window: the maps carry them."""
    model = build(family)
    n = 37
    ids = torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(n))
    maps = eager_maps(model, ids)
    cache = HeadCache(model, kv.Policy.uniform(rule))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    for layer, m in enumerate(maps):
        want = snapkv_kept(m, 2, rule)
        got = [cache.positions(layer, j).tolist() for j in range(2)]
        assert got == want, f"layer {layer}"
        sizes = [len(p) for p in got]
        if rule.adaptive:
            assert sum(sizes) == rule.group_total(2)
        else:
            assert sizes == [rule.budget] * 2
    if rule.adaptive:
        assert any(len(set(map(len, (cache.positions(l, j) for j in range(2))))) > 1 for l in range(2))


def test_the_selection_is_per_head_and_a_short_prompt_is_kept_whole():
    model = build("llama")
    ids = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(1))
    cache = HeadCache(model, kv.Policy.from_spec({(0, 0): kv.snap(10, window=4, pool=3), (1, 1): kv.snap(40, 4)}))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    assert len(cache.positions(0, 0)) == 10 and cache.positions(0, 0)[-4:].tolist() == [26, 27, 28, 29]
    assert cache.positions(1, 1).tolist() == list(range(30))  # 30 <= 40: nothing to select
    assert cache.positions(0, 1).tolist() == list(range(30))  # the full head beside it


# -- (b) decoding equals a forward in which each head sees what it kept --------------------------------------
@pytest.mark.parametrize("rule", [RULES[0], RULES[1], RULES[3], RULES[4]], ids=repr)
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_decoding_under_snapkv_equals_a_forward_over_the_kept_tokens(family, rule):
    model = build(family)
    prompt, total = 30, 50
    ids = torch.randint(3, 97, (1, total), generator=torch.Generator().manual_seed(7))
    kept = [snapkv_kept(m, 2, rule) for m in eager_maps(model, ids[:, :prompt])]
    want = _reference_logits(model, ids, kept, prompt)
    policy = kv.Policy.uniform(rule)
    got, cache = _decoded(model, ids, policy, prompt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # a question fed as one chunk after the selection (query-agnostic): the same forward
    got_q, _ = _decoded(model, ids, policy, prompt, chunk=6)
    torch.testing.assert_close(got_q, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        plain = model(input_ids=ids).logits[0]
    assert (got[prompt:] - plain[prompt:]).abs().max() > 1e-3  # the selection changes what the model sees
    assert cache.positions(0, 0)[-(total - prompt):].tolist() == list(range(prompt, total))  # every later token


def test_generate_with_a_question_after_the_compression_and_hugging_faces_generate():
    model = build("llama")
    ctx = torch.randint(3, 97, (1, 28), generator=torch.Generator().manual_seed(3))
    question = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(4))
    policy = kv.Policy.parse("adakv:10,window=4,pool=3")
    g = headlab.generate(model, ctx, question=question, policy=policy, max_new_tokens=6, stop_at_eos=False)
    assert g.question_tokens == 5 and g.prompt_tokens == 28
    ids = torch.cat([ctx, question, g.ids[:, :-1]], 1)
    kept = [snapkv_kept(m, 2, policy.default) for m in eager_maps(model, ctx)]
    want = _reference_logits(model, ids, kept, 28)[28 + 4:]
    torch.testing.assert_close(g.step_logits, want, rtol=1e-4, atol=1e-4)
    assert g.ids.tolist() == want.argmax(-1)[None].tolist()
    held = 28 + 5 + 5
    assert g.kv_bytes == policy_peak_bytes(policy, kv_heads=KVH, prompt=28, tokens=held, head_dim=8)
    # the question inside the prompt (SnapKV's own, query-aware setting): Hugging Face's generate takes the cache
    whole = torch.cat([ctx, question], 1)
    cache = HeadCache(model, policy)
    with torch.no_grad():
        hf = model.generate(whole, max_new_tokens=6, do_sample=False, cache=cache, min_new_tokens=6)[:, 33:]
    ours = headlab.generate(model, whole, policy=policy, max_new_tokens=6, stop_at_eos=False)
    assert hf.tolist() == ours.ids.tolist() and cache.peak_bytes == ours.kv_bytes


def test_perplexity_sees_the_selection_when_the_rest_is_decoded():
    model = build("llama")
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(8))
    policy = kv.Policy.snapkv(10, window=4, pool=3)
    assert perplexity(model, ids, policy=policy) == pytest.approx(perplexity(model, ids), rel=1e-5)  # one forward
    logits, _ = _decoded(model, ids, policy, 24)
    want = torch.exp(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]))
    assert perplexity(model, ids, policy=policy, prefill=24) == pytest.approx(float(want), rel=1e-5)


# -- (c) bytes -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [kv.Policy.snapkv(12, window=4, pool=3), kv.Policy.adakv(12, window=4),
                                    kv.Policy.adakv(total_per_layer=20, floor=5, window=4),
                                    kv.Policy.from_spec({(0, 0): kv.snap(8, 4), (0, 1): kv.window(2, 6),
                                                         (1, 0): kv.drop, (1, 1): kv.adakv(total=9, window=3)},
                                                        default="full")], ids=lambda p: p.name)
def test_bytes_held_equal_the_prediction_and_shrink_by_the_budget(policy):
    model = build("llama")
    prompt, new = 40, 9
    ids = torch.randint(3, 97, (1, prompt), generator=torch.Generator().manual_seed(4))
    g = headlab.generate(model, ids, policy=policy, max_new_tokens=new, stop_at_eos=False)
    held = prompt + new - 1
    assert g.kv_bytes == policy_peak_bytes(policy, kv_heads=KVH, prompt=prompt, tokens=held, head_dim=8)
    assert g.kv_bytes == policy_cache_bytes(policy, kv_heads=KVH, tokens=held, head_dim=8, prompt=prompt)
    assert g.kv_bytes_full == full_cache_bytes(layers=2, kv_heads=2, tokens=held, head_dim=8)
    per_token = 2 * 8 * 4 + 8  # a key and a value of 8 float32 numbers, and the int64 position of the kept token
    if policy.name in ("SnapKV 12", "Ada-KV 12/head"):  # every head: 12 prompt tokens + the new ones, of 40 + new
        assert g.kv_bytes == 2 * 2 * (12 + new - 1) * per_token
    if policy.name == "Ada-KV 20/layer":
        assert g.kv_bytes == 2 * (20 + 2 * (new - 1)) * per_token
    assert g.kv_bytes < g.kv_bytes_full
    _, cache = _decoded(model, torch.randint(3, 97, (1, 50), generator=torch.Generator().manual_seed(5)), policy, 33)


@pytest.mark.parametrize("text", ["adakv:12,window=4,pool=3", "snapkv:12,window=4,bits=4,group=4,residual=0",
                                  "expected:12,sink=2,future=8"])
def test_a_16_bit_storage_holds_what_a_head_keeps_in_16_bits(text):
    """``kv_dtype="float16"`` under a float32 model: every floating tensor the cache holds is float16 (a quantized
    head's scales and zero points too), the bytes are the prediction at 2 bytes a number, and the steps differ from
    the float32 cache's only by that rounding."""
    model = build("llama")
    prompt, new = 40, 9
    ids = torch.randint(3, 97, (1, prompt), generator=torch.Generator().manual_seed(4))
    policy = kv.Policy.parse(text)
    held = prompt + new - 1
    g32 = headlab.generate(model, ids, policy=policy, max_new_tokens=new, stop_at_eos=False)
    g16 = headlab.generate(model, ids, policy=policy, max_new_tokens=new, stop_at_eos=False, kv_dtype="float16")
    assert g16.kv_bytes == policy_peak_bytes(policy, kv_heads=KVH, prompt=prompt, tokens=held, head_dim=8,
                                             dtype="float16") < g32.kv_bytes
    assert g16.kv_bytes_full * 2 == g32.kv_bytes_full
    torch.testing.assert_close(g16.step_logits, g32.step_logits, rtol=0, atol=2e-2)
    cache = HeadCache(model, policy, dtype=torch.float16)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
        model(input_ids=ids[:, -1:], cache=cache, use_cache=True)
    floats = [t for layer in cache.layers for g in layer.groups for t in g._tensors() if t.is_floating_point()]
    assert floats and {t.dtype for t in floats} == {torch.float16}


def test_the_cost_model_counts_the_budget_on_smollm2s_shape():
    shape = dict(kv_heads=[3] * 30, tokens=8192, head_dim=64, dtype="float16")
    full16 = full_cache_bytes(layers=30, kv_heads=3, tokens=8192, head_dim=64, dtype="float16")
    positions = 90 * 1024 * 8  # each of the 90 kv heads holds the int64 positions of its 1,024 kept tokens
    assert policy_cache_bytes(kv.Policy.parse("snapkv:1024"), **shape) == full16 // 8 + positions  # compressed whole
    assert policy_cache_bytes(kv.Policy.parse("adakv:1024"), **shape) == full16 // 8 + positions
    assert policy_cache_bytes(kv.Policy.parse("adakv:total=3072"), **shape) == full16 // 8 + positions
    # 8,000 prompt tokens, 192 generated: 1,024 + 192 per head, each with its position
    assert policy_cache_bytes(kv.Policy.parse("snapkv:1024"), prompt=8000, **shape) == 90 * (1024 + 192) * (
        2 * 64 * 2 + 8)
    assert kv.Policy.parse("adakv:total=10,window=2").kept(30, [3], prompt=20) == [[14, 13, 13]]  # split evenly, predicted


# -- (d) Ada-KV's allocation ----------------------------------------------------------------------------------
def test_a_concentrated_head_gives_its_budget_to_a_diffuse_one():
    """Head 0's window queries point at three keys; head 1's queries are zero (uniform attention)."""
    n, d, w = 40, 8, 4
    g = torch.Generator().manual_seed(0)
    k = 0.1 * torch.randn(1, 2, n, d, generator=g)
    spikes = [3, 10, 17]
    k[0, 0, spikes] = 10 * torch.eye(d)[0]
    q = torch.zeros(1, 2, n, d)
    q[0, 0, :, 0] = 10.0
    v = torch.randn(1, 2, n, d, generator=g)
    rule = kv.adakv(total=24, floor=6, window=w, pool=1)
    layer = HeadLayer([rule, rule], n_heads=2)
    layer.update(k, v)[0].headlab_attend(None, q, None, scaling=1.0)
    pos = layer.positions()
    sizes = [len(p) for p in pos]
    assert sum(sizes) == 24 and min(sizes) >= 6
    assert sizes == [7, 17]  # the three spikes and the window; the rest to the diffuse head
    assert pos[0].tolist() == spikes + list(range(n - w, n))
    assert pos[1].tolist() == list(range(13)) + list(range(n - w, n))  # equal scores: the earlier positions
    assert layer.groups[0].budgets == [7, 17]
    # SnapKV with the same memory gives each head 12
    snap = HeadLayer([kv.snap(12, w, 1)] * 2, n_heads=2)
    snap.update(k, v)[0].headlab_attend(None, q, None, scaling=1.0)
    assert [len(p) for p in snap.positions()] == [12, 12]


def test_budgets_sum_to_the_layer_total_with_the_default_floor():
    model = build("qwen2")
    ids = torch.randint(3, 97, (1, 45), generator=torch.Generator().manual_seed(2))
    rule = kv.adakv(total=30, window=4, pool=3)
    assert rule.floor_for(2) == 4 + (15 - 4) // 5
    cache = HeadCache(model, kv.Policy.uniform(rule))
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    for layer in range(2):
        sizes = [len(cache.positions(layer, j)) for j in range(2)]
        assert sum(sizes) == 30 and min(sizes) >= rule.floor_for(2)


# -- text, files and refusals ---------------------------------------------------------------------------------
def test_policy_text_and_json_round_trip(tmp_path):
    assert kv.Policy.parse("snapkv:256").default == kv.snap(256) == kv.snap(256, window=32, pool=7)
    assert kv.Policy.parse("snap:64,window=16,pool=5,pooling=avg").default == kv.snap(64, 16, 5, pooling="avg")
    assert kv.Policy.parse("adakv:256").default == kv.adakv(256)
    assert kv.Policy.parse("adakv:total=768,floor=64,window=16").default == kv.adakv(total=768, floor=64, window=16)
    assert kv.Policy.adakv(total_per_layer=768).default == kv.adakv(total=768)
    assert kv.Policy.parse("snapkv:256").name == "SnapKV 256"
    assert kv.Policy.parse("adakv:total=768").name == "Ada-KV 768/layer"
    p = kv.Policy.from_spec({(0, 0): kv.snap(64, 8, 3, pooling="avg"), (1, 1): kv.adakv(total=99, floor=20, window=4)},
                            default=kv.adakv(32))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p.to_json()))
    back = kv.Policy.load(path)
    assert back.rules == p.rules and back.default == p.default
    assert p.counts(KVH) == {"full": 0, "window": 0, "drop": 0, "snap": 4}
    assert kv.Policy.uniform("full").counts(KVH) == {"full": 4, "window": 0, "drop": 0}
    with pytest.raises(ConfigError, match="depends on"):
        p.visible(0, 0, 8)


@pytest.mark.parametrize("make, words", [
    (lambda: kv.snap(0), "budget=0"), (lambda: kv.snap(-4), "budget=-4"), (lambda: kv.adakv(total=0), "total=0"),
    (lambda: kv.snap(16, window=32), "budget >= window"), (lambda: kv.snap(64, window=0), "window=0"),
    (lambda: kv.snap(64, pool=4), "odd"), (lambda: kv.snap(64, pooling="median"), "pooling"),
    (lambda: kv.adakv(), "exactly one"), (lambda: kv.adakv(64, total=128), "exactly one"),
    (lambda: kv.adakv(64, floor=8, window=16), "at least the window"), (lambda: kv.adakv(64, floor=65), "more than"),
    (lambda: kv.Policy.parse("snapkv:abc"), "integer"), (lambda: kv.Policy.parse("snapkv:64,colour=2"), "unknown option"),
    (lambda: kv.Policy.parse("snapkv"), "BUDGET"), (lambda: kv.Policy.parse("snapkv:64,floor=40"), "unknown option"),
    (lambda: kv.Policy.parse("snapkv:0"), "budget=0"),
])
def test_bad_budgets_are_refused(make, words):
    with pytest.raises(ConfigError, match=words):
        make()


def test_a_window_longer_than_the_prompt_and_a_floor_over_the_total_are_refused():
    model = build("llama")
    with pytest.raises(InputError, match="observation window is 16 tokens but the prompt has 10"):
        headlab.generate(model, torch.randint(3, 97, (1, 10)), policy=kv.Policy.snapkv(32, window=16))
    over = kv.Policy.adakv(total_per_layer=10, floor=6, window=4)  # 2 kv heads x 6 > 10
    for make in (lambda: HeadCache(model, over),
                 lambda: headlab.generate(model, torch.randint(3, 97, (1, 20)), policy=over),
                 lambda: policy_cache_bytes(over, kv_heads=KVH, tokens=30, head_dim=8)):
        with pytest.raises(ConfigError, match=r"2 x 6 > 10"):
            make()
    with pytest.raises(ConfigError, match="2 x 8 > 10"):  # no floor given: the window alone does not fit
        HeadCache(model, kv.Policy.adakv(total_per_layer=10, window=8))
