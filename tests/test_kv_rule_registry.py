"""Adding a KV rule is one class and its registration.

A toy rule is written here, in the test, as a user would write one: ``Strided(step)`` keeps every ``step``-th key
(positions 0, step, 2 step, ...) and the newest one (the query's own). Registered, its text reads through
``kv.as_rule`` (``"strided:2"``), a policy mixes it with a built-in rule, ``headlab.generate`` decodes with it
through :class:`headlab.decode.HeadCache` (which asks the rule what to show and what to evict), and the result is
checked against an eager forward of the same tokens with the equivalent attention mask, written here
independently of the rule, and its bytes against :func:`headlab.costs.policy_cache_bytes`. Then it is unregistered.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import transformers

import headlab
from headlab import kv
from headlab.costs import policy_cache_bytes
from headlab.decode import HeadCache
from headlab.errors import ConfigError


@dataclass(frozen=True)
class Strided(kv.Rule):
    """Keep every ``step``-th key and the newest one."""

    step: int  # keys at positions 0, step, 2 step, ... stay

    kind = "strided"
    names = ("strided",)

    def visible(self, q_pos, k_pos):
        return (k_pos <= q_pos) & ((k_pos % self.step == 0) | (k_pos == q_pos))

    def kept(self, tokens, prompt=None):
        if tokens == 0:
            return 0
        return -(-tokens // self.step) + int((tokens - 1) % self.step != 0)  # the multiples, and the newest

    def layout(self, tokens, prompt=None):
        n = self.kept(tokens, prompt)
        return kv.Layout(n, n)  # keys and values in the cache's dtype

    def text(self):
        return f"strided:{self.step}"

    @classmethod
    def from_text(cls, text, name, parts):
        if not parts or len(parts) != 1 or not parts[0].isdigit() or int(parts[0]) < 1:
            raise ConfigError(f"kv rule {text!r}: write strided:STEP with a step >= 1, e.g. strided:2")
        return cls(int(parts[0]))


@pytest.fixture
def strided():
    kv.register_rule(Strided)
    try:
        yield Strided
    finally:
        kv.unregister_rule("strided")


def _tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _oracle_mask(n: int) -> torch.Tensor:
    """``(1, 4, n, n)`` additive: query heads 0, 1 (kv head 0) every second key and the newest, heads 2, 3 (kv head 1)
    the first 2 keys and the last 3: each rule's definition, written again here."""
    t, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    strided = (j <= t) & ((j % 2 == 0) | (j == t))
    window = (j <= t) & ((j < 2) | (t - j < 3))
    vis = torch.stack([strided, strided, window, window])[None]
    return torch.zeros(vis.shape).masked_fill(~vis, torch.finfo(torch.float32).min)


def test_a_registered_rule_decodes_as_one_forward_with_its_mask(strided):
    lm = _tiny_llama()
    policy = kv.Policy.from_spec({"0.0": "strided:2", "1.0": "strided:2"}, default=kv.window(2, 3))
    assert policy.rule(1, 0) == Strided(2) and policy.counts([2, 2]) == {"full": 0, "window": 2, "drop": 0,
                                                                         "strided": 2}
    prompt = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(1))
    g = headlab.generate(lm, prompt, policy=policy, max_new_tokens=8, stop_at_eos=False)
    ids = torch.cat([prompt, g.ids[:, :-1]], 1)  # every token fed (the last one generated is not)
    n = ids.shape[1]
    lm.set_attn_implementation("eager")
    with torch.no_grad():
        want = lm(input_ids=ids, attention_mask=_oracle_mask(n)).logits[0, 19:]  # the logits each step chose from
        plain = lm(input_ids=ids).logits[0, 19:]
    torch.testing.assert_close(g.step_logits, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(g.step_logits, plain, atol=1e-3)  # the rule changed something: the check can fail
    held = sum(Strided(2).kept(n) + kv.window(2, 3).kept(n) for _ in range(2))
    assert g.kv_bytes == held * 2 * 8 * 4  # keys and values, head dim 8, float32
    assert g.kv_bytes == policy_cache_bytes(policy, kv_heads=[2, 2], tokens=n, head_dim=8, dtype=torch.float32,
                                            prompt=20)


def test_the_cache_holds_what_the_rule_keeps(strided):
    """The eviction is the rule's: after each token, a strided head holds the multiples of its step and the newest."""
    lm = _tiny_llama()
    cache = HeadCache(lm, kv.Policy.uniform("strided:3"))
    ids = torch.randint(0, 61, (1, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        lm(input_ids=ids[:, :6], cache=cache, use_cache=True)
        for t in range(6, 14):
            lm(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
            want = sorted(set(range(0, t + 1, 3)) | {t})
            assert [cache.positions(layer, h).tolist() for layer in (0, 1) for h in (0, 1)] == [want] * 4
    assert cache.nbytes() == policy_cache_bytes(kv.Policy.uniform(Strided(3)), kv_heads=[2, 2], tokens=14,
                                                head_dim=8, dtype=torch.float32)


def test_the_cache_hands_the_attention_keys_that_attend_themselves(strided):
    """decode implements the hook models defines (models knows no cache): the layer's update returns such keys."""
    from headlab.decode.cache import HeadLayer
    from headlab.models.hf.attention_fn import SelfAttendingKeys, headlab_attention_forward

    layer = HeadLayer([Strided(2), kv.window(1, 2)], n_heads=4)
    k, v, q = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 4, 5, 8)
    keys, _ = layer.update(k, v)
    assert isinstance(keys, SelfAttendingKeys)
    out, _ = headlab_attention_forward(None, q, keys, None, None, scaling=0.5)  # (B, Lq, H, d)
    t, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    vis = torch.stack([(j <= t) & ((j % 2 == 0) | (j == t))] * 2 + [(j <= t) & ((j < 1) | (t - j < 2))] * 2)
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.5).masked_fill(~vis, float("-inf"))
    want = (torch.softmax(s, -1) @ v.repeat_interleave(2, 1)).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_its_text_round_trips_and_unregistering_forgets_it(strided, tmp_path):
    p = kv.Policy.from_spec({(0, 1): Strided(4)}, default="full")
    path = tmp_path / "policy.json"
    import json

    path.write_text(json.dumps(p.to_json()))
    assert kv.Policy.load(path).rules == {(0, 1): Strided(4)}
    with pytest.raises(ConfigError, match="strided:STEP"):
        kv.as_rule("strided:x")
    kv.unregister_rule("strided")
    try:
        with pytest.raises(ConfigError, match="unknown kv rule 'strided:2'"):
            kv.as_rule("strided:2")
    finally:
        kv.register_rule(Strided)  # the fixture unregisters it


def test_registration_refuses_an_incomplete_rule_or_a_taken_name():
    @dataclass(frozen=True)
    class Blind(kv.Rule):  # no visibility, nothing kept, no text form
        names = ("blind",)

    with pytest.raises(ConfigError, match="does not define visible, from_text, kept"):
        kv.register_rule(Blind)

    @dataclass(frozen=True)
    class Impostor(Strided):
        names = ("window",)

    with pytest.raises(ConfigError, match="'window' is already registered"):
        kv.register_rule(Impostor)
    with pytest.raises(ConfigError, match="no kv rule 'blind'"):
        kv.unregister_rule("blind")
    assert "blind" not in kv.RULES and kv.RULES["window"] is kv.Window


def test_a_rules_usage_is_what_generate_help_shows():
    """The unknown-rule message and `headlab generate --help`'s --policy list the same usages (every shipped rule,
    expected:BUDGET included), from one function."""
    from headlab.decode.instrument import Generate
    from headlab.decode.rules import RULES, unknown_rule, usages

    listed = usages()
    assert all((c.usage or c.names[0]) in listed for c in RULES.values())
    assert "expected:BUDGET" in listed and listed in str(unknown_rule("nope"))
    assert Generate().option("policy").help.startswith(listed)


def test_a_storage_dtype_is_refused_for_a_store_that_cannot_hold_one(strided):
    """A rule held by a store of the user's own (not in ``STORAGE_STORES``) keeps the model's dtype: a storage dtype
    is refused, naming the rule and its store; headlab's own stores (SnapKV's included) take one."""
    from headlab.decode.cache import check_storage

    @dataclass(frozen=True)
    class Own(Strided):
        store = "own"

    with pytest.raises(ConfigError, match="held by the store 'own', which keeps the model's dtype"):
        check_storage("float16", [kv.Policy.uniform(Own(2))])
    assert check_storage("float16", [kv.Policy.parse("snapkv:64"), kv.Policy.parse("expected:64")]) == torch.float16
