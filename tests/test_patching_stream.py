"""Residual-stream sites (resid_pre, resid_post, mlp_out), their patching, the logit lens and direct logit
attribution, checked across the tiny architectures and against hand computations."""

from __future__ import annotations

import pytest
import torch

import headlab
from architectures import BUILDERS, SLOW, build, inputs
from headlab.errors import UnsupportedArchitectureError
from headlab.interpret.patching import logit_diff, patch
from headlab.interpret.patching.readout import direct_logit_attribution, logit_lens
from headlab.models import adapt

# text types, less those whose every-step test runs with `make test-slow` only (their structure is another's)
TEXT = [n for n, (_, kind) in BUILDERS.items() if kind == "text" and n not in ("deberta-v2", "albert")
        and n not in SLOW]
POS = torch.tensor([10, 6])  # the last real token of each row of inputs(): the second is padded after 7


def _logits(out):
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.mark.parametrize("name", TEXT)
def test_resid_sites_chain_and_sum(name):
    m = build(name)
    a = adapt(m)
    x = inputs(name)
    sites = ["blocks.*.attn.resid_pre", "blocks.*.attn.resid_post", "blocks.*.attn.head_out"]
    c = headlab.capture(m, x, sites)
    blocks = list(getattr(a, "model_blocks", None) or range(a.n_layers))
    if blocks != list(range(len(blocks))):  # a hybrid stack: sites named by the model's blocks, others between
        assert {a.site_name(l, "resid_post") for l in range(a.n_layers)} == {f"blocks.{b}.attn.resid_post" for b in blocks}
        others = set(range(max(blocks) + 1)) - set(blocks)
        assert all(f"blocks.{b}.attn.resid_pre" in c for b in blocks)
        assert not any(f"blocks.{b}.attn.resid_pre" in c for b in others)
        return
    assert torch.allclose(c["blocks.0.attn.resid_post"], c["blocks.1.attn.resid_pre"], atol=1e-6)
    try:
        mlp = headlab.capture(m, x, "blocks.*.attn.mlp_out")
    except UnsupportedArchitectureError as e:
        # loose MLP layers (BERT's intermediate/output, OPT's and BioGPT's fc1/fc2), or an MLP that adds the
        # residual itself (BLOOM); among types found by structure, the BERT- and OPT-like ones
        assert a.family in ("bert", "opt", "bloom") or getattr(a, "by_structure", False), a.family
        assert "no MLP module called on the stream alone" in str(e)
        return
    if getattr(a.attention_norm(0), "branch_scale", None) is not None:  # x + s * attn + s * mlp (Granite's multiplier)
        return
    if getattr(getattr(a, "found", None), "token_mixers", None):  # a mixer beside the attention (Falcon-H1's Mamba)
        return
    if a.attention_norm(0).layout in ("pre", "parallel"):  # the block is x + attn + mlp
        for l in range(2):
            b = a.b_O(l)
            attn = c[f"blocks.{l}.attn.head_out"].sum(1) + (0 if b is None else b)
            want = c[f"blocks.{l}.attn.resid_pre"] + attn + mlp[f"blocks.{l}.attn.mlp_out"]
            assert torch.allclose(want, c[f"blocks.{l}.attn.resid_post"], atol=1e-5)
    # an edit of mlp_out reaches the stream unchanged in pre, parallel and post-less blocks
    delta = torch.randn(c["blocks.0.attn.resid_post"].shape[-1])
    if a.attention_norm(0).layout in ("pre", "parallel"):
        e = headlab.capture(m, x, "blocks.0.attn.resid_post", edits={"blocks.0.attn.mlp_out": lambda t, s: t + delta})
        assert torch.allclose(e["blocks.0.attn.resid_post"], c["blocks.0.attn.resid_post"] + delta, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "gemma2", "falcon"])
def test_patching_the_whole_stream_gives_the_corrupted_run(name):
    m = build(name)
    x = inputs(name, padded=False)
    bad = dict(x, input_ids=(x["input_ids"] * 7 + 3) % 97)
    with torch.no_grad():
        want = _logits(m(**bad))
    for site in ("blocks.1.attn.resid_pre", "blocks.0.attn.resid_post"):
        src = headlab.capture(m, bad, site)[site]
        got = headlab.capture(m, x, [], edits={site: lambda t, s, src=src: src}).outputs
        assert torch.allclose(_logits(got), want, atol=1e-5), site
    if name in ("gpt2", "llama"):  # per layer through patch(): the whole stream at block 1's input carries it all
        metric = logit_diff([3, 4], [5, 6])
        r = patch(m, x, bad, metric, sites=["resid_pre", "resid_post", "mlp_out"], positions="each")
        assert r.effects["resid_pre"].shape == (2, 1, 11)
        full = patch(m, x, bad, metric, sites=["resid_pre"])
        # the stream entering any block, at every position, is all the model knows of its input
        assert full.effects["resid_pre"][:, 0].tolist() == pytest.approx([1.0, 1.0], abs=1e-4)
        # only the last position can move the last position's logits directly after the last block
        assert r.raw["resid_post"][1, 0, :-1].abs().max() < 1e-5


def test_residual_sites_refused_where_blocks_are_shared_or_stacked():
    for name in ("albert", "t5"):
        m = build(name)
        with pytest.raises(UnsupportedArchitectureError, match="residual-stream sites"):
            headlab.capture(m, inputs(name), "blocks.0.attn.resid_post" if name == "albert" else
                            "encoder.0.attn.resid_post")


@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma", "gpt_neox", "gemma2", "opt"])
def test_logit_lens_ends_at_the_models_logits(name):
    m = build(name)
    x = inputs(name)
    lens = logit_lens(m, x, position=POS)
    with torch.no_grad():
        out = m(**x).logits[torch.arange(2), POS]
    assert lens.logits.shape == (3, 2, 97)
    assert torch.allclose(lens.logits[-1], out, atol=1e-4)
    assert lens.logit_diff([3, 4], [5, 6])[-1].tolist() == pytest.approx((out[[0, 1], [3, 4]] - out[[0, 1], [5, 6]]).tolist(), abs=1e-4)
    if name == "gpt2":  # entry 0 by hand: ln_f(wte + wpe) @ wte^T
        t = m.transformer
        with torch.no_grad():
            emb = t.wte(x["input_ids"]) + t.wpe(torch.arange(11))
            want = m.lm_head(t.ln_f(emb))[torch.arange(2), POS]
        assert torch.allclose(lens.logits[0], want, atol=1e-5)


def _hand_dla(m, x, layers, out_projs, W_O, norm_w, centred, eps, W_U, correct, wrong):
    """Per head: (z_h @ W_O[h], normalised by the final norm's own statistics at this run, times its weight)
    projected on W_U[correct] - W_U[wrong]; z_h read off each output projection's input."""
    zs, final = [], {}
    hooks = [o.register_forward_pre_hook(lambda mod, a: zs.append(a[0].detach())) for o in out_projs]
    hooks.append(layers[-1].register_forward_hook(lambda mod, a, o: final.__setitem__("x", o[0] if isinstance(o, tuple) else o)))
    with torch.no_grad():
        m(**x)
    for h in hooks:
        h.remove()
    xf = final["x"][torch.arange(2), POS]  # (B, E)
    xc = xf - xf.mean(-1, keepdim=True) if centred else xf
    s = (xc.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    direction = W_U[correct] - W_U[wrong]  # (B, E)
    out = torch.zeros(2, len(out_projs), 4)
    for l, z in enumerate(zs):
        z = z[torch.arange(2), POS].view(2, 4, 8)  # (B, H, d)
        for h in range(4):
            part = z[:, h] @ W_O(l)[h]  # (B, E)
            part = part - part.mean(-1, keepdim=True) if centred else part
            out[:, l, h] = ((norm_w * part / s) * direction).sum(-1)
    return out


def test_dla_equals_hand_computation_and_sums_to_the_logit_difference():
    correct, wrong = torch.tensor([3, 4]), torch.tensor([5, 6])
    for name in ("gpt2", "llama"):
        m = build(name)
        a = adapt(m)
        x = inputs(name)
        d = direct_logit_attribution(m, x, correct, wrong, position=POS)
        with torch.no_grad():
            out = m(**x).logits[torch.arange(2), POS]
        ld = out[[0, 1], correct] - out[[0, 1], wrong]
        assert torch.allclose(d.logit_diff, ld, atol=1e-5)
        assert torch.allclose(d.per_example.sum((1, 2)) + d.rest, ld, atol=1e-4)
        if name == "gpt2":
            t = m.transformer
            hand = _hand_dla(m, x, t.h, [b.attn.c_proj for b in t.h], a.W_O, t.ln_f.weight, True, t.ln_f.eps,
                             m.lm_head.weight, correct, wrong)
        else:
            mm = m.model
            hand = _hand_dla(m, x, mm.layers, [b.self_attn.o_proj for b in mm.layers], a.W_O, mm.norm.weight, False,
                             mm.norm.variance_epsilon, m.lm_head.weight, correct, wrong)
        assert torch.allclose(d.per_example, hand, atol=1e-4), name
        assert d.top(3)[0][:2] == divmod(int(d.heads.abs().argmax()), 4)
    with pytest.raises(UnsupportedArchitectureError, match="sandwich"):
        direct_logit_attribution(build("gemma2"), inputs("gemma2"), 3, 5)
    with pytest.raises(UnsupportedArchitectureError, match="output embedding"):
        logit_lens(build("bert"), inputs("bert"))
