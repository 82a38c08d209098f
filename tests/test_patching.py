"""Patching against hand-written hooks: exact, attribution and path patching on tiny models.

The oracles here never go through headlab's capture or sites: they hook the model's own modules
(the output projection's input is the heads' z, concatenated; a key projection's output is k before
any rotary embedding, which patches the same way because both runs share their positions).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from architectures import build
from headlab.errors import ConfigError, InputError, ShapeError
from headlab.interpret.patching import (attribution_patch, compare, logit_diff, patch, path_patch)
from headlab.models.transformer import Transformer, TransformerConfig

B, L, V = 3, 7, 41
CORRECT, WRONG = [3, 5, 7], [11, 13, 17]


def _model(n_kv_heads=None, layers=3):
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=V, d_model=32, n_layers=layers, n_heads=4, n_kv_heads=n_kv_heads, causal=True)
    m = Transformer(cfg).eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so the model is far from linear
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return m


def _pair(vocab=V):
    g = torch.Generator().manual_seed(5)
    clean = torch.randint(0, vocab, (B, L), generator=g)
    corrupt = clean.clone()
    corrupt[:, 1] = torch.randint(0, vocab, (B,), generator=g)
    corrupt[:, 4] = torch.randint(0, vocab, (B,), generator=g)
    return clean, corrupt


def _metric_value(m, ids, metric):
    with torch.no_grad():
        out = m(**ids) if isinstance(ids, dict) else m(ids)
    return float(metric(out.logits).mean())


class _SliceHook:
    """Record, or replace, a slice ``[..., h*w:(h+1)*w]`` (positions ``pos``) of a module's input or output."""

    def __init__(self, module, where, width):
        self.module, self.where, self.width, self.seen, self.put = module, where, width, None, None

    def __enter__(self):
        def fix(x):
            self.seen = x.detach().clone()
            if self.put is None:
                return x
            h, pos, src = self.put
            x = x.clone()
            sl = slice(h * self.width, (h + 1) * self.width)
            x[:, pos, sl] = src[:, pos, sl]
            return x

        if self.where == "in":
            self.h = self.module.register_forward_pre_hook(lambda mod, args: (fix(args[0]), *args[1:]))
        else:
            self.h = self.module.register_forward_hook(lambda mod, args, out: fix(out))
        return self

    def __exit__(self, *exc):
        self.h.remove()


def _hand_patch(m, module, where, width, clean, corrupt, metric, h, pos=slice(None)):
    with _SliceHook(module, where, width) as hook:
        _metric_value(m, corrupt, metric)
        src = hook.seen
        hook.put = (h, pos, src)
        return _metric_value(m, clean, metric)


def test_exact_z_and_positions_equal_hand_hooks():
    m = _model()
    clean, corrupt = _pair()
    metric = logit_diff(CORRECT, WRONG)
    m_clean, m_corrupt = _metric_value(m, clean, metric), _metric_value(m, corrupt, metric)
    r = patch(m, clean, corrupt, metric)
    rp = patch(m, clean, corrupt, metric, positions=[1, 4, 6], max_rows=7)  # several forwards
    assert r.clean == pytest.approx(m_clean, abs=1e-5) and r.corrupted == pytest.approx(m_corrupt, abs=1e-5)
    for l, blk in enumerate(m.blocks):
        for h in range(4):
            want = _hand_patch(m, blk.attn.out_proj, "in", 8, clean, corrupt, metric, h)
            assert float(r.raw["z"][l, h]) == pytest.approx(want - m_clean, abs=1e-4)
            assert float(r.effects["z"][l, h]) == pytest.approx((want - m_clean) / (m_corrupt - m_clean), abs=1e-4)
            for i, p in enumerate([1, 4, 6]):
                want = _hand_patch(m, blk.attn.out_proj, "in", 8, clean, corrupt, metric, h, pos=p)
                assert float(rp.raw["z"][l, h, i]) == pytest.approx(want - m_clean, abs=1e-4)
    # positions the corruption cannot reach yet (before token 1, causal) have no effect
    r0 = patch(m, clean, corrupt, metric, positions=[0])
    assert r0.raw["z"].abs().max() < 1e-5


def test_exact_q_k_v_on_gqa_equal_hand_hooks():
    m = _model(n_kv_heads=2, layers=2)
    clean, corrupt = _pair()
    metric = logit_diff(CORRECT, WRONG)
    m_clean = _metric_value(m, clean, metric)
    r = patch(m, clean, corrupt, metric, sites=["q", "k", "v"])
    assert r.effects["q"].shape == (2, 4) and r.effects["k"].shape == (2, 2) and r.effects["v"].shape == (2, 2)
    for l, blk in enumerate(m.blocks):
        for kind, proj, heads in (("q", blk.attn.q_proj, 4), ("k", blk.attn.k_proj, 2), ("v", blk.attn.v_proj, 2)):
            for h in range(heads):
                want = _hand_patch(m, proj, "out", 8, clean, corrupt, metric, h)
                assert float(r.raw[kind][l, h]) == pytest.approx(want - m_clean, abs=1e-4), (kind, l, h)
    assert any("kv head" in n for n in r.notes)


def test_exact_k_on_llama_with_rotary_and_padding():
    m = build("llama")  # GQA, rotary (patching k after rotary = patching k_proj's output: same positions)
    ids = torch.randint(2, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 7:] = 0
    bad = ids.clone()
    bad[:, 2] = (ids[:, 2] + 7) % 97
    clean, corrupt = {"input_ids": ids, "attention_mask": mask}, {"input_ids": bad, "attention_mask": mask}
    metric = logit_diff([5, 6], [8, 9], position=[8, 6])
    m_clean = _metric_value(m, clean, metric)
    r = patch(m, clean, corrupt, metric, sites=["k", "z"])
    for l, layer in enumerate(m.model.layers):
        for h in range(2):
            want = _hand_patch(m, layer.self_attn.k_proj, "out", 8, clean, corrupt, metric, h)
            assert float(r.raw["k"][l, h]) == pytest.approx(want - m_clean, abs=1e-4)
        for h in range(4):
            want = _hand_patch(m, layer.self_attn.o_proj, "in", 8, clean, corrupt, metric, h)
            assert float(r.raw["z"][l, h]) == pytest.approx(want - m_clean, abs=1e-4)


def test_exact_pattern_equals_hand_recomputed_head():
    """Patching head h's map = its output recomputed as pattern_corrupted @ v_clean (maps from the model's own
    output_attentions, v from its v_proj)."""
    m = _model(layers=2)
    clean, corrupt = _pair()
    metric = logit_diff(CORRECT, WRONG)
    m_clean = _metric_value(m, clean, metric)
    r = patch(m, clean, corrupt, metric, sites="pattern", positions=[4])
    with torch.no_grad():
        maps = m(corrupt, output_attentions=True).attentions  # per layer (B, H, L, L)
    for l, blk in enumerate(m.blocks):
        with _SliceHook(blk.attn.v_proj, "out", 8) as vh:
            _metric_value(m, clean, metric)
        for h in range(4):
            v = vh.seen.view(B, L, 4, 8)[:, :, h]  # (B, L, d)
            z_new = maps[l][:, h] @ v  # (B, L, d)
            src = torch.zeros(B, L, 32)
            src[:, :, h * 8:(h + 1) * 8] = z_new
            with _SliceHook(blk.attn.out_proj, "in", 8) as oh:
                oh.put = (h, 4, src)
                want = _metric_value(m, clean, metric)
            assert float(r.raw["pattern"][l, h, 0]) == pytest.approx(want - m_clean, abs=1e-4)


def test_attribution_equals_hand_gradient_times_delta():
    m = _model(layers=2)
    clean, corrupt = _pair()
    metric = logit_diff(CORRECT, WRONG)
    r = attribution_patch(m, clean, corrupt, metric, positions="each")
    ra = attribution_patch(m, clean, corrupt, metric)
    gap = r.corrupted - r.clean
    for l, blk in enumerate(m.blocks):
        with _SliceHook(blk.attn.out_proj, "in", 8) as hk:
            _metric_value(m, corrupt, metric)
        z_corrupt = hk.seen
        leaf = {}

        def grab(mod, args):
            leaf["z"] = args[0].detach().requires_grad_(True)
            return (leaf["z"],)

        hd = blk.attn.out_proj.register_forward_pre_hook(grab)
        try:
            metric(m(clean).logits).mean().backward()
        finally:
            hd.remove()
        est = ((z_corrupt - leaf["z"].detach()) * leaf["z"].grad).view(B, L, 4, 8).sum((0, 3))  # (L, H)
        assert torch.allclose(r.raw["z"][l], est.T, atol=1e-5)
        assert torch.allclose(ra.effects["z"][l], est.sum(0) / gap, atol=1e-4)


def _tracks(exact, approx) -> tuple[bool, dict]:
    """The bound attribution patching must meet where its linear approximation is near exact: the heads
    ranked alike (Spearman >= 0.9, computed here with scipy on the effects), the same top 3 heads by
    |effect|, each effect within 0.05 of the exact one (effects are normalised by the clean-corrupted gap)."""
    from scipy.stats import spearmanr

    a, b = exact.effects["z"].flatten().double(), approx.effects["z"].flatten().double()
    rho = float(spearmanr(a.numpy(), b.numpy()).statistic)
    top = set(a.abs().argsort(descending=True)[:3].tolist()) == set(b.abs().argsort(descending=True)[:3].tolist())
    close = float((a - b).abs().max()) <= 0.05
    return rho >= 0.9 and top and close, {"spearman": rho, "top3": top, "close": close}


def test_attribution_tracks_exact_and_compare():
    # near-linear: weights of std 0.05 keep every activation small, so the first-order estimate is near exact
    torch.manual_seed(0)
    small = Transformer(TransformerConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, causal=True)).eval()
    with torch.no_grad():
        for p in small.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    clean, corrupt = _pair()
    metric = logit_diff(CORRECT, WRONG)
    ex, at = patch(small, clean, corrupt, metric), attribution_patch(small, clean, corrupt, metric)
    assert float(ex.effects["z"].abs().max()) > 0.2 and float(ex.effects["z"].std()) > 0.05  # the heads differ
    ok, why = _tracks(ex, at)
    assert ok, why
    c = compare(ex, at, k=3)  # the library's own agreement figures equal the ones computed here
    assert c["n"] == 8 and c["spearman"] == pytest.approx(why["spearman"], abs=1e-9) and c["top3_overlap"] == 3
    # the bound can fail: an attribution with its sign flipped, or its heads shuffled, misses it
    flipped = dataclasses.replace(at, effects={k: -v for k, v in at.effects.items()})
    assert not _tracks(ex, flipped)[0] and compare(ex, flipped)["spearman"] < 0
    perm = torch.tensor([3, 7, 1, 5, 0, 2, 6, 4])
    shuffled = dataclasses.replace(at, effects={"z": at.effects["z"].flatten()[perm].view(2, 4)})
    assert not _tracks(ex, shuffled)[0]
    # far from linear (weights of std 0.3) the estimate is only rough, and compare() still reports it
    m = _model(layers=2)
    ex, at = patch(m, clean, corrupt, metric), attribution_patch(m, clean, corrupt, metric)
    c = compare(ex, at)
    assert c["n"] == 8 and -1 <= c["spearman"] <= 1
    # an exact linear case: a patch that changes nothing is estimated as nothing (position 0 precedes every
    # corrupted token, so in a causal model its activations are the clean ones)
    each = attribution_patch(m, clean, corrupt, metric, positions="each")
    assert each.raw["z"][..., 0].abs().max() == 0 and each.raw["z"][..., 1].abs().max() > 0
    with pytest.raises(InputError, match="same input"):  # identical inputs: every effect would be 0/0
        attribution_patch(m, clean, clean, metric)


def test_path_patching_equals_hand_frozen_runs():
    m = _model(layers=3)
    clean, corrupt = _pair()
    metric = logit_diff(CORRECT, WRONG)
    m_clean = _metric_value(m, clean, metric)
    outs = [blk.attn.out_proj for blk in m.blocks]
    z_clean, z_corrupt = [], []
    for ids, keep in ((clean, z_clean), (corrupt, z_corrupt)):
        for o in outs:
            with _SliceHook(o, "in", 8) as hk:
                _metric_value(m, ids, metric)
            keep.append(hk.seen)

    def sender_run(sl, sh, record=None):
        hooks = []
        for l, o in enumerate(outs):
            src = z_clean[l].clone()
            if l == sl:
                src[..., sh * 8:(sh + 1) * 8] = z_corrupt[l][..., sh * 8:(sh + 1) * 8]
            hooks.append(o.register_forward_pre_hook(lambda mod, args, s=src: (s,)))
        try:
            if record is None:
                return _metric_value(m, clean, metric)
            with _SliceHook(record, "out", 8) as rec:
                _metric_value(m, clean, metric)
            return rec.seen
        finally:
            for hd in hooks:
                hd.remove()

    to_logits = path_patch(m, clean, corrupt, metric, max_rows=5)
    to_q = path_patch(m, clean, corrupt, metric, receivers=[(2, 1)], receiver_input="q")
    assert torch.isnan(to_q.raw["z"][2]).all()
    for sl in range(3):
        for sh in range(4):
            assert float(to_logits.raw["z"][sl, sh]) == pytest.approx(sender_run(sl, sh) - m_clean, abs=1e-4)
            if sl < 2:
                q_seen = sender_run(sl, sh, record=m.blocks[2].attn.q_proj)
                with _SliceHook(m.blocks[2].attn.q_proj, "out", 8) as hk:
                    hk.put = (1, slice(None), q_seen)
                    want = _metric_value(m, clean, metric)
                assert float(to_q.raw["z"][sl, sh]) == pytest.approx(want - m_clean, abs=1e-4)
    # the last layer's heads reach the logits directly: path patching them is exact patching
    ex = patch(m, clean, corrupt, metric, layers=[2])
    assert torch.allclose(to_logits.raw["z"][2], ex.raw["z"][2], atol=1e-5)


def test_batching_does_not_change_results():
    m = _model(layers=2)
    clean, corrupt = _pair()
    metric = logit_diff(CORRECT, WRONG)
    a = patch(m, clean, corrupt, metric, sites=["z", "v"], max_rows=1)
    b = patch(m, clean, corrupt, metric, sites=["z", "v"], max_rows=1000)
    for k in ("z", "v"):
        assert torch.allclose(a.raw[k], b.raw[k], atol=1e-5)


def test_result_export_and_rendering():
    m = _model(layers=2)
    clean, corrupt = _pair()
    r = patch(m, clean, corrupt, logit_diff(CORRECT, WRONG), sites=["z", "k"], positions="each")
    j = json.loads(json.dumps(r.to_json()))
    assert j["method"] == "exact" and len(j["effects"]["z"]) == 2 and len(j["effects"]["z"][0][0]) == L
    assert j["convention"].startswith("(m_patched - m_clean)")
    top = r.top(3)
    assert len(top) == 3 and abs(top[0][2]) >= abs(top[1][2]) >= abs(top[2][2])
    assert "layer" in r.table() and r._repr_html_().startswith("<iframe")
    assert "<h2>k</h2>" in r.page()


def test_typed_errors():
    m = _model(layers=2)
    clean, corrupt = _pair()
    metric = logit_diff(CORRECT, WRONG)
    with pytest.raises(ShapeError, match="same length"):
        patch(m, clean, corrupt[:, :5], metric)
    with pytest.raises(ConfigError, match="kinds"):
        patch(m, clean, corrupt, metric, sites="head_out")
    with pytest.raises(ConfigError, match="position"):
        patch(m, clean, corrupt, metric, positions=[L])
    with pytest.raises(ConfigError, match="metric"):
        patch(m, clean, corrupt, lambda logits: logits[:, -1, :2])
    with pytest.raises(ConfigError, match="out of range"):
        path_patch(m, clean, corrupt, metric, receivers=[(5, 0)])
    with pytest.raises(ConfigError, match="before the last receiver"):
        path_patch(m, clean, corrupt, metric, receivers=[(0, 1)])
    with pytest.raises(ConfigError, match="receiver_input"):
        path_patch(m, clean, corrupt, metric, receivers=[(1, 1)], receiver_input="z")
    with pytest.raises(ShapeError, match="ids for a batch"):
        patch(m, clean, corrupt, logit_diff([1, 2], [3, 4]))


def test_interrupt_keeps_what_was_measured(monkeypatch):
    from headlab.interpret.patching import runs

    m = _model(layers=2)
    clean, corrupt = _pair()
    metric = logit_diff(CORRECT, WRONG)
    real, calls = runs.run_metric, []

    def flaky(pair, metric, inputs, copies, edits=None, **kw):
        if edits:
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
        return real(pair, metric, inputs, copies, edits=edits, **kw)

    monkeypatch.setattr(runs, "run_metric", flaky)
    r = patch(m, clean, corrupt, metric, max_rows=2 * B)  # two heads per forward: 4 of 8 measured
    assert int((~torch.isnan(r.raw["z"])).sum()) == 4 and "interrupted after 4 of 8" in r.notes[0]


def test_path_patching_into_keys_of_a_gqa_receiver():
    """Receiver 2.3 reads kv head 3 // 2 = 1: its key input is k_proj's second slice, as the sender run left it."""
    m = _model(n_kv_heads=2, layers=3)
    clean, corrupt = _pair()
    metric = logit_diff(CORRECT, WRONG)
    m_clean = _metric_value(m, clean, metric)
    outs = [blk.attn.out_proj for blk in m.blocks]
    z = {}
    for name, ids in (("clean", clean), ("corrupt", corrupt)):
        z[name] = []
        for o in outs:
            with _SliceHook(o, "in", 8) as hk:
                _metric_value(m, ids, metric)
            z[name].append(hk.seen)
    r = path_patch(m, clean, corrupt, metric, receivers=[(2, 3)], receiver_input="k", senders=[(0, 2), (1, 0)])
    for sl, sh in ((0, 2), (1, 0)):
        hooks = []
        for l, o in enumerate(outs):
            src = z["clean"][l].clone()
            if l == sl:
                src[..., sh * 8:(sh + 1) * 8] = z["corrupt"][l][..., sh * 8:(sh + 1) * 8]
            hooks.append(o.register_forward_pre_hook(lambda mod, args, s=src: (s,)))
        with _SliceHook(m.blocks[2].attn.k_proj, "out", 8) as rec:
            _metric_value(m, clean, metric)
        for hd in hooks:
            hd.remove()
        with _SliceHook(m.blocks[2].attn.k_proj, "out", 8) as hk:
            hk.put = (1, slice(None), rec.seen)
            want = _metric_value(m, clean, metric)
        assert float(r.raw["z"][sl, sh]) == pytest.approx(want - m_clean, abs=1e-4)
    assert torch.isnan(r.raw["z"]).sum() == 12 - 2 and any("kv head" in n for n in r.notes)


def test_path_patching_interrupt_keeps_what_was_measured(monkeypatch):
    from headlab.interpret.patching import path as P

    m = _model(layers=2)
    clean, corrupt = _pair()
    real, calls = P._sender_chunk, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(P, "_sender_chunk", flaky)
    r = path_patch(m, clean, corrupt, logit_diff(CORRECT, WRONG), max_rows=3 * B, progress=True)
    assert int((~torch.isnan(r.raw["z"])).sum()) == 3 and any("interrupted after 3 of 8" in n for n in r.notes)
