"""Adding a KV store is one class and its registration.

A toy store is written here, as a user would write one: ``ListStore`` (``"list"``) keeps each kv head's keys and
values as a Python list of one-token tensors and attends with an explicit softmax under the rule's visibility. A
rule names it (``store = "list"``); :class:`headlab.decode.HeadCache` then holds that rule's heads in it, and a
greedy decode with it matches, logit for logit, the same decode with the built-in ``"plain"`` store. Then it is
unregistered, and a rule that names it is refused before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import transformers

import headlab
from headlab import kv
from headlab.decode import HeadCache
from headlab.decode.store import STORES, KVStore, register_store, unregister_store
from headlab.errors import ConfigError


class ListStore(KVStore):
    """Every key and value the rule keeps, one token at a time, in lists (slow and plain on purpose)."""

    name = "list"

    def reset(self) -> None:
        self.k, self.v, self.pos = [], [], []  # (B, heads, 1, d) each, and their positions
        self.appended = 0

    def append(self, k, v, new_pos) -> None:
        for i, p in enumerate(new_pos.tolist()):
            self.k.append(k[:, :, i:i + 1])
            self.v.append(v[:, :, i:i + 1])
            self.pos.append(p)
        self.appended += len(new_pos)

    @property
    def v_dim(self):
        return self.v[0].shape[-1] if self.v else None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def positions(self):
        return [torch.tensor(self.pos, dtype=torch.long)] * len(self.kv)

    def attend(self, attention, q, q_pos, hf, scaling, softcap, *, fresh):
        k, v = torch.cat(self.k, 2), torch.cat(self.v, 2)  # (B, heads, held, d)
        pos = torch.tensor(self.pos)
        vis = self.rule.visible(q_pos[:, None], pos[None, :])  # (m, held)
        if hf is not None:
            vis = vis & hf.index_select(-1, pos.to(hf.device))
        k, v = k.repeat_interleave(self.rep, 1), v.repeat_interleave(self.rep, 1)
        s = (q.float() @ k.float().transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
        out = torch.softmax(s.masked_fill(~vis, float("-inf")), -1) @ v.float()
        keep = self.rule.retain(pos, int(q_pos[-1]))  # what stays once the last query has attended
        self.k = [t for t, y in zip(self.k, keep.tolist()) if y]
        self.v = [t for t, y in zip(self.v, keep.tolist()) if y]
        self.pos = [p for p, y in zip(self.pos, keep.tolist()) if y]
        return out.to(q.dtype)


@dataclass(frozen=True)
class ListedWindow(kv.Window):
    """A window whose heads the list store holds (a rule names its store; the store asks the rule)."""

    store = "list"


@pytest.fixture
def listed():
    register_store(ListStore)
    try:
        yield ListStore
    finally:
        if "list" in STORES:
            unregister_store("list")


def _tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256,
                                   attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_a_store_registered_from_outside_holds_the_heads_its_rule_names(listed):
    assert STORES["list"] is ListStore and STORES["plain"].__name__ == "PlainStore"
    lm = _tiny_llama()
    prompt = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(1))
    window = kv.window(2, 5)
    listed_window = ListedWindow(**{f: getattr(window, f) for f in window.__dataclass_fields__})
    mixed = kv.Policy.from_spec({"0.0": listed_window, "1.1": listed_window}, default=window)
    plain = kv.Policy.from_spec({"0.0": window, "1.1": window}, default=window)
    got = headlab.generate(lm, prompt, policy=mixed, max_new_tokens=6, stop_at_eos=False)
    want = headlab.generate(lm, prompt, policy=plain, max_new_tokens=6, stop_at_eos=False)
    assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.step_logits, want.step_logits, rtol=1e-4, atol=1e-4)

    cache = HeadCache(lm, mixed)
    with torch.no_grad():
        lm(input_ids=prompt, cache=cache, use_cache=True)
    stores = [g for layer in cache.layers for g in layer.groups]
    held = [g for g in stores if isinstance(g, ListStore)]
    assert len(held) == 2 and all(g.appended == 12 for g in held)
    # the list store keeps what the window keeps: the 2 sinks and the 5 most recent positions
    assert held[0].pos == [0, 1, 7, 8, 9, 10, 11]


def test_registration_refuses_an_incomplete_store_or_a_taken_name(listed):
    class Forgetful(KVStore):  # holds keys but never attends
        name = "forgetful"

        def reset(self):
            pass

        def append(self, k, v, new_pos):
            pass

    with pytest.raises(ConfigError, match="does not define nbytes, attend"):
        register_store(Forgetful)

    class Impostor(ListStore):
        name = "plain"

    with pytest.raises(ConfigError, match=r"a kv store named 'plain' is already registered \(PlainStore\)"):
        register_store(Impostor)
    with pytest.raises(ConfigError, match="register_store takes a subclass"):
        register_store(dict)
    unregister_store("list")
    with pytest.raises(ConfigError, match="no kv store 'list' is registered; the stores: none, plain"):
        unregister_store("list")
    with pytest.raises(ConfigError, match=r"held by the store 'list', which is not one of the cache's stores"):
        HeadCache(_tiny_llama(), kv.Policy.uniform(ListedWindow(2, 5)))
