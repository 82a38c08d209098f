"""Hybrid stacks (blocks without attention between attention blocks), transformers' pin to eager, and the refusal
reasons of differential attention and of a gate before the output projection (headlab.models.hf.hybrid, pinned,
variants, layout).

Every step of the hybrids in tests/architectures.py runs in tests/test_architectures.py; here: the layer numbering,
the token-mixing test against a perturbation done by hand, and the refusals' reasons.
"""

from __future__ import annotations

import architectures as A
import pytest
import torch
import transformers as T
from torch import nn

import headlab
from headlab.errors import SiteError, UnsupportedArchitectureError
from headlab.models import adapt


class HandWrittenAttention(nn.Module):  # a hand-written attention class at the top of this file: transformers'
    """heuristic reads the file and pins the model class below to eager (see headlab.models.hf.pinned)."""

    def forward(self, x):
        return x


class PinnedGranite(T.GraniteForCausalLM):
    """Granite (a type headlab adapts by structure), defined in this file: transformers decides whether it may switch
    attention by reading this file."""

    _can_set_attn_implementation_cached_value = None  # not Granite's cached answer: this file's


def _mixes(model, x, i) -> bool:
    """Does block i's output at positions 1.. change when its input at position 0 does (by hand, two runs)?"""
    block = model.base_model.layers[i]
    outs = []

    def keep(m, args, kwargs, out):
        outs.append((out[0] if isinstance(out, tuple) else out).detach().clone())

    def move(m, args, kwargs):
        h = (args[0] if args else kwargs["hidden_states"]).clone()
        h[:, 0] += 1.0
        return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

    h1 = block.register_forward_hook(keep, with_kwargs=True)
    with torch.no_grad():
        model(**x)
        h2 = block.register_forward_pre_hook(move, with_kwargs=True)
        model(**x)
    h1.remove()
    h2.remove()
    return not torch.allclose(outs[0][:, 1:], outs[1][:, 1:], atol=1e-6, rtol=0)


def test_a_hybrid_has_its_attention_blocks_as_layers_named_by_the_models_block_index():
    model = A.build("jamba")
    x = A.inputs("jamba", padded=False)
    a = adapt(model)
    layers = model.model.layers
    assert (a.n_layers, a.model_blocks, a.site_prefixes) == (2, [1, 3], ["blocks.1.attn", "blocks.3.attn"])
    assert a.attn_modules[1] is layers[3].self_attn and a.out_projs[0] is layers[1].self_attn.o_proj
    assert a.found.summary()["attention_blocks"].startswith("[1, 3] of 4")
    with torch.no_grad():
        eager = model(**x, output_attentions=True)
    cache = headlab.capture(model, x, ["blocks.*.attn.pattern"])
    assert sorted(cache) == ["blocks.1.attn.pattern", "blocks.3.attn.pattern"]
    torch.testing.assert_close(cache["blocks.3.attn.pattern"], eager.attentions[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(SiteError):  # block 0 is a Mamba block: no heads, no sites
        headlab.capture(model, x, ["blocks.0.attn.pattern"])
    # gates are indexed by headlab's layers: layer 1's head 2 is the model's block 3, columns 16..23 of its o_proj
    with torch.no_grad():
        a.gates[1, 2] = 0.0
        gated = model(**x).logits
        a.reset_gates()
        w = layers[3].self_attn.o_proj.weight
        saved = w.clone()
        w[:, 2 * A.D:3 * A.D] = 0.0
        zeroed = model(**x).logits
        w.copy_(saved)
    torch.testing.assert_close(gated, zeroed, atol=1e-6, rtol=1e-6)


def test_blocks_that_mix_tokens_are_found_as_a_perturbation_by_hand_finds_them():
    jamba, nemotron = A.build("jamba"), A.build("nemotron_h")
    x = A.inputs("jamba", padded=False)
    assert adapt(jamba).found.token_mixers == {0: "JambaMambaDecoderLayer", 2: "JambaMambaDecoderLayer"}
    assert [_mixes(jamba, x, i) for i in (0, 2)] == [True, True]
    assert adapt(nemotron).found.token_mixers == {}  # its blocks 1 and 3 are MLP-only
    assert [_mixes(nemotron, x, i) for i in (1, 3)] == [False, False]
    seq = {k: v[:1] for k, v in x.items()}
    for fn in (headlab.rollout, headlab.attention_flow):
        with pytest.raises(UnsupportedArchitectureError, match=r"blocks 0, 2 \(no attention\) mix tokens"):
            fn(jamba, seq)
    # a Mamba mixer beside the attention in every block (Falcon-H1)
    with pytest.raises(UnsupportedArchitectureError, match=r"blocks 0, 1 \(beside their attention\)"):
        headlab.rollout(A.build("falcon_h1"), seq)


def _pinned():
    torch.manual_seed(0)
    return PinnedGranite(T.GraniteConfig(**A._common(num_key_value_heads=A.KV))).eval()


def test_a_model_transformers_pins_to_eager_is_diagnosed_as_that_with_the_way_out(monkeypatch):
    import headlab.models.hf.own_bridge as own_bridge
    import headlab.models.hf.structure as structure

    assert not PinnedGranite._can_set_attn_implementation()  # transformers' own answer, from this file's source
    for where in (own_bridge, structure):  # no own-math bridge: the attention interface or nothing
        monkeypatch.setattr(where, "bridge", lambda *a, **k: None)
    with pytest.raises(UnsupportedArchitectureError) as e:
        adapt(_pinned())
    msg = str(e.value)
    assert "transformers pins PinnedGranite to its eager attention" in msg and "HandWrittenAttention" in msg
    assert "do call the interface once that pin is lifted" in msg and "_can_set_attn_implementation" in msg
    assert "none of its modules calls" not in msg
    # the way out the message gives: lifted, the model is served and checked
    monkeypatch.setattr(PinnedGranite, "_can_set_attn_implementation", classmethod(lambda cls: True))
    model = _pinned()
    a = adapt(model)
    x = A.inputs("llama", padded=False)
    with torch.no_grad():
        eager = model(**x, output_attentions=True)
    cache = headlab.capture(model, x, a.sites("pattern"))
    torch.testing.assert_close(cache["blocks.1.attn.pattern"], eager.attentions[1], atol=1e-5, rtol=1e-5)


def test_differential_attention_is_refused_as_that():
    model = T.DiffLlamaForCausalLM(T.DiffLlamaConfig(**A._common(num_key_value_heads=A.KV))).eval()
    with pytest.raises(UnsupportedArchitectureError, match="2 attention calls each time it runs: differential") as e:
        adapt(model)
    assert "'groupnorm' before the output projection" in str(e.value) and "serves several layers" not in str(e.value)


def test_a_gate_before_the_output_projection_is_refused_naming_it():
    cfg = T.Qwen3NextConfig(**{**A._HYB, "layer_types": ["linear_attention", "full_attention"] * 2},
                            linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                            linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                            shared_expert_intermediate_size=16, attn_implementation="eager")
    with pytest.raises(UnsupportedArchitectureError, match=r"'self_attn.o_proj' reads it multiplied elementwise by a gate"):
        adapt(T.Qwen3NextForCausalLM(cfg).eval())
