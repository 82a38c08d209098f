"""The per-head KV cache: decoding under a policy equals one forward with the policy's visibility, the
full cache equals Hugging Face's greedy generate, and the bytes held equal the cost model's prediction.

The reference here is written independently of headlab's cache: an attention function registered with
transformers that materialises every head's scores and masks them with the rule's definition
(key j visible to query t when j <= t and (j < sink or t - j < recent); nothing for a dropped head).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import headlab
from headlab import kv
from headlab.costs.kv import full_cache_bytes, policy_cache_bytes
from headlab.decode import HeadCache, perplexity
from headlab.errors import ConfigError, InputError, ModelError, UnsupportedArchitectureError
from tests import architectures
from tests.architectures import BUILDERS, build

# the types a headlab family declares (architectures.py also builds base models that no family names)
_DECLARED = set(getattr(architectures, "DECLARED", BUILDERS))
ENCODERS = ("bert", "roberta", "distilbert", "albert", "electra", "deberta-v2", "xlm-roberta", "modernbert", "eurobert")
DECODERS = [n for n, (_, kind) in BUILDERS.items() if kind == "text" and n in _DECLARED and n not in ENCODERS]
OWN_FORWARD = ("bloom", "falcon")  # compute attention in their own modules: the full cache only


def _rule_visible(rule, n: int) -> torch.Tensor:
    t, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    if isinstance(rule, kv.Drop):
        return torch.zeros(n, n, dtype=torch.bool)
    vis = j <= t
    if isinstance(rule, kv.Window):
        vis = vis & ((j < rule.sink) | (t - j < rule.recent))
    return vis


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    policy = module._kv_test_policy
    B, H, n, d = query.shape
    rep = H // key.shape[1]
    k, v = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    s = (query @ k.transpose(-1, -2)) * (scaling if scaling is not None else d ** -0.5)  # (B, H, n, n)
    if kwargs.get("softcap") is not None:
        s = torch.tanh(s / kwargs["softcap"]) * kwargs["softcap"]
    vis = torch.stack([_rule_visible(policy.rule(module.layer_idx, h // rep), n) for h in range(H)])  # (H, n, n)
    if attention_mask is not None:
        m = attention_mask if attention_mask.dtype == torch.bool else attention_mask > torch.finfo(s.dtype).min / 2
        vis = vis & m
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1).nan_to_num(0.0)  # a dropped head's rows: zeros
    return (p @ v).transpose(1, 2).contiguous(), None


AttentionInterface.register("kv_test_reference", _reference_attention)
AttentionMaskInterface.register("kv_test_reference", sdpa_mask)


def _reference_logits(model, ids, policy):
    for m in model.modules():
        if hasattr(m, "layer_idx"):
            m._kv_test_policy = policy
    saved = model.config._attn_implementation
    model.set_attn_implementation("kv_test_reference")
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits[0]
    finally:
        model.set_attn_implementation(saved)


def _decoded_logits(model, ids, policy, prefill: int):
    """Prefill ``prefill`` tokens, then feed the rest one token at a time (teacher forcing)."""
    cache = HeadCache(model, policy)
    out = []
    with torch.no_grad():
        out.append(model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits[0])
        for t in range(prefill, ids.shape[1]):
            out.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0])
    return torch.cat(out), cache


def _mixed_policy(layers: int = 2):
    # 2 kv heads per layer in the grouped-query families (4 otherwise): every rule, sink-only and recent-only too
    return kv.Policy.from_spec({(0, 0): kv.window(sink=2, recent=3), (0, 1): kv.drop, (1, 0): kv.window(sink=0, recent=4),
                                (1, 1): kv.window(sink=3, recent=0)}, default="full")


@pytest.mark.parametrize("family", ["llama", "gpt2", "mistral", "gemma2", "qwen3", "phi3", "gpt_neox", "olmo2"])
def test_decoding_under_a_policy_equals_one_forward_with_its_visibility(family):
    """Mistral and Gemma 2 bring their own sliding windows (intersected with the rule), Gemma 2 soft-capping."""
    model = build(family)
    torch.manual_seed(3)
    ids = torch.randint(3, 97, (1, 19))
    policy = _mixed_policy()
    want = _reference_logits(model, ids, policy)
    got, _ = _decoded_logits(model, ids, policy, prefill=7)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # and the prompt as one prefill (what perplexity runs)
    one, _ = _decoded_logits(model, ids, policy, prefill=19)
    torch.testing.assert_close(one, want, rtol=1e-4, atol=1e-4)


def test_a_policy_changes_the_logits_and_the_full_policy_does_not():
    """The reference comparison above could pass if policies did nothing: they do something."""
    model = build("llama")
    ids = torch.randint(3, 97, (1, 19), generator=torch.Generator().manual_seed(0))
    full, _ = _decoded_logits(model, ids, kv.Policy.uniform("full"), prefill=5)
    with torch.no_grad():
        plain = model(input_ids=ids).logits[0]
    torch.testing.assert_close(full, plain, rtol=1e-4, atol=1e-4)
    windowed, _ = _decoded_logits(model, ids, kv.Policy.uniform(kv.window(1, 2)), prefill=5)
    assert not torch.allclose(windowed[8:], plain[8:], atol=1e-3)


def test_long_prefill_of_windowed_heads_runs_on_the_sparse_kernel(monkeypatch):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=512,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (1, 300))
    policy = kv.Policy.from_spec({(0, 1): kv.window(4, 40), (1, 0): kv.window(4, 40)})
    import headlab.decode.cache as cache_mod

    calls = []
    real = cache_mod._attention

    def spy(*args, **kw):
        calls.append(kw.get("backend", "auto"))
        return real(*args, **kw)

    monkeypatch.setattr(cache_mod, "_attention", spy)
    got, _ = _decoded_logits(model, ids, policy, prefill=300)
    # per layer: the full group (auto), the windowed group's band (sparse) and its sinks (auto)
    assert calls.count("sparse") == 2 and len(calls) == 6
    torch.testing.assert_close(got, _reference_logits(model, ids, policy), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", DECODERS)
def test_the_full_cache_reproduces_hugging_faces_greedy_generate(family):
    model = build(family)
    prompt = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    got = headlab.generate(model, prompt, max_new_tokens=6)
    assert got.ids.tolist() == want[:, 12:].tolist()
    assert got.step_logits.shape == (got.ids.shape[1], model.config.vocab_size)
    assert got.kv_bytes == got.kv_bytes_full  # the full cache holds what the cost model says


def test_hugging_face_generate_takes_the_cache_and_decodes_as_headlab_does():
    model = build("qwen2")
    prompt = torch.randint(3, 97, (1, 15), generator=torch.Generator().manual_seed(2))
    policy = _mixed_policy()
    cache = HeadCache(model, policy)
    with torch.no_grad():
        hf = model.generate(prompt, max_new_tokens=7, do_sample=False, cache=cache)[:, 15:]
    ours = headlab.generate(model, prompt, policy=policy, max_new_tokens=7)
    assert hf.tolist() == ours.ids.tolist()
    assert cache.peak_bytes == ours.kv_bytes


@pytest.mark.parametrize("policy", [kv.Policy.uniform("full"), kv.Policy.uniform(kv.window(4, 9)), _mixed_policy(),
                                    kv.Policy.uniform("drop")])
def test_measured_cache_bytes_equal_the_prediction(policy):
    model = build("llama")
    prompt = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(4))
    g = headlab.generate(model, prompt, policy=policy, max_new_tokens=10, stop_at_eos=False)
    held = 30 + g.ids.shape[1] - 1
    predicted = policy_cache_bytes(policy, kv_heads=[2, 2], tokens=held, head_dim=8, dtype=torch.float32)
    assert abs(g.kv_bytes - predicted) <= 0.05 * max(predicted, 1)
    assert g.kv_bytes == predicted  # exactly, in fact: the tensors are sized to what the rules keep
    assert g.kv_bytes_full == 2 * 2 * 2 * 8 * held * 4  # k and v x layers x kv heads x head dim x tokens x float32
    if policy.default == kv.full and not policy.rules:
        assert g.kv_bytes == g.kv_bytes_full
    else:
        assert g.kv_bytes < g.kv_bytes_full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_full_is_the_closed_form_and_hugging_faces_own_cache(dtype):
    # the ordinary cache's bytes, not from the cost model: the closed form written out here, and what
    # transformers' own DynamicCache holds after a forward over the same tokens (no headlab code involved)
    model = build("llama").to(dtype)  # 2 layers, 4 query heads on 2 kv heads (GQA), 32 wide: head dim 8
    prompt = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(4))
    g = headlab.generate(model, prompt, policy=kv.Policy.uniform(kv.window(4, 9)), max_new_tokens=10,
                         stop_at_eos=False)  # a windowed policy: what it holds is not the full cache
    held = 30 + g.ids.shape[1] - 1  # the last token is never fed back
    per_number = {torch.float32: 4, torch.bfloat16: 2}[dtype]
    assert g.kv_bytes_full == 2 * 2 * 2 * 8 * held * per_number  # k and v x layers x kv heads x head dim x tokens
    with torch.no_grad():
        cache = model(torch.cat([prompt, g.ids[:, :-1]], 1), use_cache=True).past_key_values
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert len(tensors) == 4 and all(t.shape == (1, 2, held, 8) and t.dtype == dtype for t in tensors)
    assert g.kv_bytes_full == sum(t.numel() * t.element_size() for t in tensors)
    assert g.kv_bytes_full == full_cache_bytes(layers=2, kv_heads=2, tokens=held, head_dim=8, dtype=dtype)
    assert g.kv_bytes < g.kv_bytes_full


def test_sampling_is_reproducible_with_a_seed():
    model = build("llama")
    prompt = torch.randint(3, 97, (1, 8), generator=torch.Generator().manual_seed(5))
    a = headlab.generate(model, prompt, max_new_tokens=12, sample=True, seed=7, temperature=1.5, stop_at_eos=False)
    b = headlab.generate(model, prompt, max_new_tokens=12, sample=True, seed=7, temperature=1.5, stop_at_eos=False)
    c = headlab.generate(model, prompt, max_new_tokens=12, sample=True, seed=8, temperature=1.5, stop_at_eos=False)
    greedy = headlab.generate(model, prompt, max_new_tokens=12, stop_at_eos=False)
    assert a.ids.tolist() == b.ids.tolist()
    assert a.ids.tolist() != c.ids.tolist() or a.ids.tolist() != greedy.ids.tolist()


def test_perplexity_under_a_policy_equals_the_decoded_logits():
    model = build("llama")
    ids = torch.randint(3, 97, (1, 25), generator=torch.Generator().manual_seed(6))
    policy = _mixed_policy()
    logits, _ = _decoded_logits(model, ids, policy, prefill=1)
    want = torch.exp(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]))
    assert perplexity(model, ids, policy=policy, chunk=7) == pytest.approx(float(want), rel=1e-5)


# -- policies -------------------------------------------------------------------------------------------
def test_gqa_keeps_a_kv_head_full_when_any_of_its_query_heads_needs_it():
    model = build("llama")  # 4 query heads, 2 kv heads: query heads 0, 1 read kv head 0
    scores = torch.tensor([[0.0, 0.9, 0.1, 0.2], [0.3, 0.0, 0.0, 0.05]])
    p = kv.Policy.from_importance(model, scores, keep=0.25, rest=kv.window(4, 8))
    assert p.rule(0, 0) == kv.full  # its query head 1 scores 0.9
    assert [p.rule(0, 1), p.rule(1, 0), p.rule(1, 1)] == [kv.window(4, 8)] * 3
    atlas = {"scores": {"sink": torch.zeros(2, 4), "local": torch.tensor([[1.0, 1.0, 0.2, 1.0], [1.0] * 4])}}
    assert kv.Policy.from_atlas(model, atlas, keep=0.25).rule(0, 1) == kv.full
    r1, r2 = kv.Policy.random(model, keep=0.5, seed=1), kv.Policy.random(model, keep=0.5, seed=1)
    assert r1.rules == r2.rules and r1.counts([2, 2]) == {"full": 2, "window": 2, "drop": 0}


def test_policy_text_and_json_round_trip(tmp_path):
    assert kv.Policy.parse("streaming:4,256").default == kv.window(4, 256)
    p = _mixed_policy()
    path = tmp_path / "p.json"
    import json

    path.write_text(json.dumps(p.to_json()))
    assert kv.Policy.load(path).rules == p.rules


@pytest.mark.parametrize("make, error, words", [
    (lambda: kv.window(sink=-1, recent=4), ConfigError, "negative"),
    (lambda: kv.window(sink=2, recent=-3), ConfigError, "negative"),
    (lambda: kv.window(sink=0, recent=0), ConfigError, "kv.drop"),
    (lambda: kv.Policy.parse("streaming:4"), ConfigError, "SINK,RECENT"),
    (lambda: kv.Policy.parse("sliding"), ConfigError, "unknown kv rule"),
])
def test_bad_rules_are_refused(make, error, words):
    with pytest.raises(error, match=words):
        make()


@pytest.mark.parametrize("spec, words", [({(2, 0): "full"}, "layer 2"), ({(0, 2): "drop"}, "kv head 2 of layer 0"),
                                         ({(-1, 0): "drop"}, "layer -1")])
def test_a_policy_for_a_layer_or_kv_head_the_model_lacks_is_refused(spec, words):
    model = build("llama")
    with pytest.raises(ConfigError, match=words):
        headlab.generate(model, torch.tensor([[5, 6, 7]]), policy=kv.Policy.from_spec(spec), max_new_tokens=2)


def test_encoder_only_models_and_bad_prompts_are_refused():
    with pytest.raises(ModelError, match="encoder-only"):
        headlab.generate(build("bert"), torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    with pytest.raises(ModelError, match="encoder-only"):
        HeadCache(build("bert"))
    model = build("llama")
    with pytest.raises(InputError, match="0..96"):
        headlab.generate(model, torch.tensor([[5, 600]]))
    with pytest.raises(InputError, match="tokenizer"):
        headlab.generate(model, "a text")
    with pytest.raises(InputError, match="positions"):
        headlab.generate(model, torch.randint(0, 97, (1, 60)), max_new_tokens=10)
    with pytest.raises(UnsupportedArchitectureError, match="policy=None"):
        headlab.generate(build("bloom"), torch.tensor([[5, 6]]), policy=kv.Policy.uniform(kv.window(1, 2)))


def test_dropping_a_kv_head_equals_pruning_its_query_heads_physically():
    """``drop`` keeps no key and zeroes its query heads: the model that pruning really makes smaller."""
    model = build("llama")  # query heads 0, 1 of each layer read kv head 0
    prompt = torch.randint(3, 97, (1, 14), generator=torch.Generator().manual_seed(9))
    dropped = headlab.generate(model, prompt, policy=kv.Policy.from_spec({(0, 0): kv.drop}), max_new_tokens=6,
                               stop_at_eos=False)
    pruned = headlab.prune_heads(model, {0: [0, 1]})
    assert pruned.adapter.layer_kv_heads == [1, 2]
    after = headlab.generate(pruned, prompt, max_new_tokens=6, stop_at_eos=False)
    assert after.ids.tolist() == dropped.ids.tolist()
    torch.testing.assert_close(after.step_logits, dropped.step_logits, rtol=1e-4, atol=1e-4)
    assert after.kv_bytes == dropped.kv_bytes  # the same keys held, one way or the other
    # and windows on the pruned model: its kv heads are renumbered, layer 0 has one
    both = headlab.generate(pruned, prompt, policy=kv.Policy.from_spec({(0, 0): kv.window(2, 3)}), max_new_tokens=6)
    assert both.kv_bytes < after.kv_bytes


def test_a_cache_that_would_not_fit_is_refused_before_decoding(monkeypatch):
    from headlab.errors import MemoryBudgetError

    monkeypatch.setenv("HEADLAB_MEMORY_LIMIT", "2KB")
    with pytest.raises(MemoryBudgetError, match="KV cache"):
        headlab.generate(build("llama"), torch.randint(3, 97, (1, 40)), max_new_tokens=5)


def test_window_loss_is_the_evicted_attention_mass_of_the_last_rows():
    from headlab.decode.calibrate import window_loss

    model = build("llama")  # eager: its own maps are the reference
    prompts = [torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(n)) for n in (30, 41)]
    rule = kv.window(2, 5)
    got = window_loss(model, prompts, rule, rows=4)
    want = torch.zeros(2, 4, dtype=torch.float64)
    for ids in prompts:
        n = ids.shape[1]
        with torch.no_grad():
            maps = model(input_ids=ids, output_attentions=True).attentions  # (1, H, n, n) per layer
        t, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        lost = (j <= t) & (j >= rule.sink) & (t - j >= rule.recent)
        for layer, a in enumerate(maps):
            want[layer] += (a[0] * lost).sum(-1)[:, n - 4:].double().mean(-1) / len(prompts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(got.max()) > 0.05  # random weights spread mass far back: the check above is not 0 == 0
    with pytest.raises(InputError, match="longer than"):
        window_loss(model, [torch.randint(3, 97, (1, 9))], rule, rows=4)


def test_a_reset_cache_decodes_as_a_new_one():
    model = build("llama")
    prompt = torch.randint(3, 97, (1, 20), generator=torch.Generator().manual_seed(11))
    policy = _mixed_policy()
    cache = HeadCache(model, policy)
    with torch.no_grad():
        first = model.generate(prompt, max_new_tokens=6, do_sample=False, cache=cache)
        cache.reset()
        assert cache.nbytes() == 0
        again = model.generate(prompt, max_new_tokens=6, do_sample=False, cache=cache)
    assert first.tolist() == again.tolist()
