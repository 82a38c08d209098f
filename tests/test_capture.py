"""headlab.capture: sites, shapes, identities between captured tensors, gradients, statistics, cleanup."""

from __future__ import annotations

import pytest
import torch
import transformers

import headlab
from headlab.attention import backends as hb
from headlab.errors import ConfigError, InputError
from headlab.models import adapt
from headlab.models.transformer import Transformer, TransformerConfig

L = 9


def _decoder(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True)
    return Transformer(cfg).to(dtype).eval()


def _bert():
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, attn_implementation="eager")).eval()


def _ids():
    return torch.randint(0, 61, (2, L), generator=torch.Generator().manual_seed(3))


def test_default_sites_and_shapes():
    m = _decoder()
    cache = headlab.capture(m, _ids())
    B, H, Hkv, d, E = 2, 4, 2, 8, 32
    shapes = {"q": (B, H, L, d), "k": (B, Hkv, L, d), "v": (B, Hkv, L, d), "pattern": (B, H, L, L),
              "z": (B, H, L, d), "head_out": (B, H, L, E)}
    assert sorted(cache) == sorted(f"blocks.{i}.attn.{k}" for i in range(2) for k in shapes)
    for i in range(2):
        for kind, shape in shapes.items():
            assert cache[f"blocks.{i}.attn.{kind}"].shape == shape
    assert cache.stack("pattern").shape == (2, B, H, L, L)
    assert not cache.grads and not any(t.requires_grad for t in cache.values())


def test_site_selection_errors():
    m = _decoder()
    with pytest.raises(ConfigError, match="matches nothing"):
        headlab.capture(m, _ids(), ["blocks.7.attn.pattern"])
    with pytest.raises(ConfigError, match="scalar"):
        headlab.capture(m, _ids(), "blocks.0.attn.z", grads=True)
    with pytest.raises(InputError, match="LoadedModel"):
        headlab.capture(m, "some text", "blocks.0.attn.z")
    with pytest.raises(KeyError, match="not captured"):
        headlab.capture(m, _ids(), "blocks.0.attn.z")["blocks.0.attn.q"]


def test_pattern_and_head_out_identities():
    """pattern = softmax(q k^T / sqrt(d)) with the causal mask; z = pattern @ v; head_out sums to W^O's output."""
    m = _bert()
    a = adapt(m)
    inputs = {"input_ids": _ids(), "attention_mask": torch.ones(2, L, dtype=torch.long)}
    inputs["attention_mask"][0, 6:] = 0
    outs = {}
    hooks = [op.register_forward_hook(lambda mod, args, out, i=i: outs.__setitem__(i, out))
             for i, op in enumerate(a.out_projs)]
    try:
        cache = headlab.capture(m, inputs, backend="sdpa")
    finally:
        for h in hooks:
            h.remove()
    keep = inputs["attention_mask"].bool()[:, None, None, :]  # (B, 1, 1, L)
    for i in range(2):
        q, k, v = (cache[f"blocks.{i}.attn.{x}"] for x in "qkv")
        expect = headlab.attention_weights(q, k, mask=keep)
        torch.testing.assert_close(cache[f"blocks.{i}.attn.pattern"], expect, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(cache[f"blocks.{i}.attn.z"], expect @ v, atol=1e-6, rtol=1e-5)
        total = cache[f"blocks.{i}.attn.head_out"].sum(1) + a.b_O(i)
        torch.testing.assert_close(total, outs[i], atol=1e-5, rtol=1e-5)


def test_gradients_satisfy_the_chain_rule():
    """out = P v per head, so dS/dP = dS/dz v^T and dS/dv = sum over the heads sharing v of P^T dS/dz;
    dS/dgate = sum(dS/dz * z) for gates at 1; every head's dS/dhead_out equals dS/d(W^O output)."""
    m = _decoder(torch.float64)
    a = adapt(m)
    a.gates = torch.ones(2, 4, dtype=torch.float64).requires_grad_(True)
    try:
        cache = headlab.capture(m, _ids(), ["blocks.0.attn.pattern", "blocks.0.attn.v", "blocks.0.attn.z",
                                            "blocks.1.attn.head_out"],
                                grads=True, scalar=lambda out: out.logits[1, -1].logsumexp(-1))
    finally:
        a.reset_gates()
    g = cache.grads
    P, v, z = cache["blocks.0.attn.pattern"], cache["blocks.0.attn.v"], cache["blocks.0.attn.z"]
    dz = g["blocks.0.attn.z"]
    v_per_head = v.repeat_interleave(2, dim=1)  # (B, H, L, d): query head h reads kv head h // 2
    torch.testing.assert_close(g["blocks.0.attn.pattern"], dz @ v_per_head.transpose(-1, -2))
    dv = (P.transpose(-1, -2) @ dz).view(2, 2, 2, L, 8).sum(2)  # sum over the 2 heads of each kv head
    torch.testing.assert_close(g["blocks.0.attn.v"], dv)
    torch.testing.assert_close(g["gates"][0], (dz * z).sum(dim=(0, 2, 3)))
    dho = g["blocks.1.attn.head_out"]
    assert dho.abs().max() > 0
    for h in range(1, 4):
        torch.testing.assert_close(dho[:, h], dho[:, 0])
    assert cache.scalar.ndim == 0


def test_hooks_removed_after_an_exception():
    """An error in the scalar, in headlab's own checks or inside the model's forward leaves no hook, no
    probe and no backend behind: the model then computes what an identical, never-captured twin does."""
    m = _bert()
    a = adapt(m)
    before = [(len(mod._forward_hooks), len(mod._forward_pre_hooks)) for mod in m.modules()]
    impl = m.config._attn_implementation

    def boom(out):
        raise RuntimeError("scalar failed")

    with pytest.raises(RuntimeError, match="scalar failed"):
        headlab.capture(m, {"input_ids": _ids()}, grads=True, scalar=boom, backend="sdpa")
    with pytest.raises(ConfigError, match=r"scalar\(outputs\) must return a one-element tensor, got float"):
        headlab.capture(m, _ids(), grads=True, scalar=lambda out: 1.0, backend="sdpa")
    with pytest.raises(InputError, match=r"token id 99 is outside the vocabulary of 61 tokens \(ids 0..60\)"):
        headlab.capture(m, torch.full((1, 4), 99))
    # the model's own error, past its 32 position embeddings (torch's message, passed through untouched)
    with pytest.raises(RuntimeError, match=r"expanded size of the tensor \(40\) must match the existing size \(32\)"):
        headlab.capture(m, {"input_ids": torch.full((1, 40), 1)})
    assert [(len(mod._forward_hooks), len(mod._forward_pre_hooks)) for mod in m.modules()] == before
    assert m.config._attn_implementation == impl
    assert all(am._headlab.probe is None and am._headlab.backend is None for am in a.attn_modules)
    with torch.no_grad():  # and the model still runs as before: as its twin (same seed, same weights), never adapted
        out = m(_ids(), output_attentions=True)
        twin = _bert()(_ids(), output_attentions=True)
    torch.testing.assert_close(out.last_hidden_state, twin.last_hidden_state, rtol=0, atol=0)
    for got, want in zip(out.attentions, twin.attentions, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_stats_site_matches_the_pattern():
    m = _bert()
    inputs = {"input_ids": _ids(), "attention_mask": torch.ones(2, L, dtype=torch.long)}
    inputs["attention_mask"][1, 5:] = 0
    cache = headlab.capture(m, inputs, ["blocks.*.attn.pattern", "blocks.*.attn.stats"], backend="tiled",
                            stats_kwargs={"key_positions": [0]})
    real = inputs["attention_mask"].bool()[:, None, :]  # (B, 1, L) real query rows
    for i in range(2):
        P = cache[f"blocks.{i}.attn.pattern"]
        st = cache[f"blocks.{i}.attn.stats"]
        ent = -(P * P.clamp_min(1e-30).log()).sum(-1)
        torch.testing.assert_close(st.entropy.masked_fill(~real, 0), ent.masked_fill(~real, 0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.key_mass[..., 0], P[..., 0], atol=1e-6, rtol=1e-5)


def test_stats_without_pattern_never_materialises(monkeypatch):
    m = _decoder()
    ref = hb.get("reference")
    monkeypatch.setattr(type(ref), "forward", lambda *a, **k: pytest.fail("a map was materialised"))
    cache = headlab.capture(m, _ids(), "blocks.*.attn.stats", backend="sdpa")
    assert cache["blocks.1.attn.stats"].entropy.shape == (2, 4, L)


@pytest.mark.parametrize("make", [_bert, _decoder], ids=["bert_padded", "decoder_gqa"])
def test_stats_capture_runs_attention_once_and_keeps_the_outputs(make, monkeypatch):
    """Capturing statistics takes each layer's output from the statistics' own pass: the model's
    outputs are those of the uncaptured model, and no second attention call runs."""
    import headlab.models.sites as sites

    m = make()
    ids = _ids()
    inputs = {"input_ids": ids, "attention_mask": torch.ones(2, L, dtype=torch.long)} if make is _bert else ids
    if make is _bert:
        inputs["attention_mask"][1, 4:] = 0
    with torch.no_grad():
        plain = headlab.capture(m, inputs, "blocks.1.attn.head_out", backend="sdpa")
    calls = []
    real = sites.attention_with_weights
    monkeypatch.setattr(sites, "attention_with_weights", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cache = headlab.capture(m, inputs, ["blocks.*.attn.stats", "blocks.1.attn.head_out"], backend="sdpa")
    assert calls == []  # every layer's output came from attention_stats
    assert cache["blocks.0.attn.stats"].output is None  # the output is not kept in the cache
    torch.testing.assert_close(cache["blocks.1.attn.head_out"], plain["blocks.1.attn.head_out"], atol=1e-5, rtol=1e-5)
    out_a = cache.outputs.last_hidden_state if make is _bert else cache.outputs.logits
    out_b = plain.outputs.last_hidden_state if make is _bert else plain.outputs.logits
    torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=1e-5)


def test_grads_at_a_stream_site_are_refused_with_the_sites_that_have_them():
    """The residual stream and the statistics are recorded beside the graph: grads=True there was a bare
    RuntimeError from autograd; it is a ConfigError naming the sites and what to do."""
    import transformers

    from headlab.errors import ConfigError

    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    ids = torch.randint(0, 32, (1, 5))
    for site in ("blocks.1.attn.resid_pre", "blocks.0.attn.resid_post", "blocks.0.attn.stats"):
        with pytest.raises(ConfigError, match=f"not at {site.rsplit('.', 1)[-1]}; capture those without grads"):
            headlab.capture(m, ids, ["blocks.0.attn.z", site], grads=True, scalar=lambda o: o.logits[0, -1, 3])
    g = headlab.capture(m, ids, ["blocks.0.attn.z"], grads=True, scalar=lambda o: o.logits[0, -1, 3])
    assert g.grads["blocks.0.attn.z"].abs().max() > 0
