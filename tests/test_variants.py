"""Variants read by structure or a short declaration (issue 40, item 4): a scaled residual branch (a residual
multiplier, LayerScale) decomposed by residual-mode norms; a per-head value norm served with W_V refused; a norm
over all heads' values, a sub-norm before the output projection and LongT5's blocked local attention refused,
each with its reason. Every number is held against the model's own run, recorded here by hooks on its modules."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers as T
from transformers.models.llama import modeling_llama as ML

import headlab
from headlab.errors import HeadlabError, UnsupportedArchitectureError
from headlab.models.hf.structure import adapter_class_for
from headlab.models.hf.verify import verify

sys.path.insert(0, str(Path(__file__).resolve().parent))
import architectures as A  # noqa: E402

IDS = {"input_ids": torch.tensor([[5, 17, 3, 41, 8, 22, 9, 30, 12]])}
PIX = {"pixel_values": torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(3))}


def _perturbed(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms, biases and LayerScale vectors: none of them trivially one or zero
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


# (builder, input, the block's own scale as the model holds it, the norm that reads the stream after attention)
SCALED = {
    "granite": (A._llama_like(T.GraniteConfig, T.GraniteForCausalLM, residual_multiplier=0.3), IDS,
                lambda b: b.residual_multiplier, "post_attention_layernorm"),
    "dinov2": (lambda: T.Dinov2Model(T.Dinov2Config(**{k: v for k, v in A._VIS.items() if k != "intermediate_size"},
                                                    mlp_ratio=2, layerscale_value=0.5)), PIX,
               lambda b: b.layer_scale1.lambda1, "norm2"),
    "beit": (lambda: T.BeitModel(T.BeitConfig(**A._VIS, layer_scale_init_value=0.3)), PIX,
             lambda b: b.lambda_1, "layernorm_after"),
}


@pytest.mark.parametrize("name", list(SCALED))
def test_residual_norms_decompose_a_scaled_branch_into_the_models_own_stream(name):
    build, x, scale_of, next_norm = SCALED[name]
    model = _perturbed(build())
    a = headlab.models.adapt(model)
    assert "branch scaled by" in a.found.summary()["blocks"]["norms"]
    assert verify(a).passed
    rec: dict = {}
    handles = []
    for l, block in enumerate(a.blocks):
        handles.append(a.attn_modules[l].register_forward_pre_hook(
            lambda m, args, kw, l=l: rec.__setitem__(("x", l), a.value_input(l, args, kw)[0].detach().double()),
            with_kwargs=True))
        handles.append(block.register_forward_pre_hook(
            lambda m, args, kw, l=l: rec.__setitem__(("in", l), (args[0] if args else kw["hidden_states"])[0].double()),
            with_kwargs=True))
        handles.append(block.get_submodule(next_norm).register_forward_pre_hook(
            lambda m, args, l=l: rec.__setitem__(("h", l), args[0][0].detach().double())))
    try:
        with torch.no_grad():
            maps = model(**x, output_attentions=True).attentions
    finally:
        for h in handles:
            h.remove()
    res = headlab.attention_norms(model, x, mode="residual")
    att = headlab.attention_norms(model, x, mode="attention")
    for l, block in enumerate(a.blocks):
        s = scale_of(block)
        s = s.detach().double() if isinstance(s, torch.Tensor) else float(s)
        P = maps[l][0].double()
        xa = rec[("x", l)]
        v = torch.einsum("ne,ked->knd", xa, a.W_V(l).detach().double())
        if a.b_V(l) is not None:
            v = v + a.b_V(l).detach().double().unsqueeze(1)
        f = torch.einsum("hnd,hde->hne", v.repeat_interleave(a.n_heads // a.n_kv_heads, 0), a.W_O(l).detach().double())
        mix = torch.einsum("hij,hje->ije", P, f)
        torch.testing.assert_close(att.layer[l].double(), mix.norm(dim=-1), atol=1e-5, rtol=1e-4)  # the attention's own
        n = P.shape[-1]
        bO = a.b_O(l).detach().double() if a.b_O(l) is not None else torch.zeros(xa.shape[-1], dtype=torch.float64)
        F = s * mix + torch.eye(n, dtype=torch.float64).unsqueeze(-1) * rec[("in", l)].unsqueeze(0)
        torch.testing.assert_close(F.sum(1) + s * bO, rec[("h", l)], atol=1e-4, rtol=1e-4)  # the model's stream
        torch.testing.assert_close(res.layer[l].double(), F.norm(dim=-1), atol=1e-5, rtol=1e-4)
        want = P * (s * f).norm(dim=-1).unsqueeze(1)
        torch.testing.assert_close(res.per_head[l].double(), want, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(res.layer[l].double(), (mix + (F - s * mix)).norm(dim=-1), atol=1e-3)  # s matters


def test_the_residual_check_fails_a_view_that_leaves_the_scale_out():
    model = _perturbed(SCALED["granite"][0]())
    cls, _ = adapter_class_for(model)
    assert cls.norms.branch_scale == "residual_multiplier"
    wrong = type("NoScale", (cls,), {"norms": replace(cls.norms, branch_scale=None)})(model)
    try:
        failed = verify(wrong, cache=False).failed
    finally:
        wrong.close()
    assert failed is not None and failed.name == "residual"
    with pytest.raises(UnsupportedArchitectureError, match="scales its attention branch"):
        from headlab.interpret.circuits.graph import graph

        graph(model)


# -- a value norm ---------------------------------------------------------------------------------------------------
class _VNormAttention(ML.LlamaAttention):
    """Llama's attention with an RMSNorm on each head's values after v_proj (as Gemma 3n's and Gemma 4's v_norm);
    ``across=True``: one norm over all heads' values together."""

    def __init__(self, config, layer_idx, across=False):
        super().__init__(config, layer_idx)
        self.across = across
        width = config.num_key_value_heads * self.head_dim if across else self.head_dim
        self.v_norm = ML.LlamaRMSNorm(width, eps=1e-6)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        raw = self.v_proj(hidden_states)
        v = (self.v_norm(raw).view(shape) if self.across else self.v_norm(raw.view(shape))).transpose(1, 2)
        q, k = ML.apply_rotary_pos_emb(q, k, *position_embeddings)
        fn = ML.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, ML.eager_attention_forward)
        out, w = fn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), w


class VNormConfig(T.LlamaConfig):
    model_type = "llama_vnorm"


def _vnorm_model(across=False):
    torch.manual_seed(0)
    cfg = VNormConfig(**A._common(num_key_value_heads=A.KV, pad_token_id=0, eos_token_id=2, bos_token_id=1))
    model = T.LlamaForCausalLM(cfg)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn = _VNormAttention(cfg, i, across)
    return _perturbed(model)


def test_a_per_head_value_norm_is_served_with_w_v_refused():
    model = _vnorm_model()
    a = headlab.models.adapt(model)  # found by structure and checked: values through the norm
    assert a.value_norm == "v_norm" and "v_norm" in a.found.summary()["blocks"]["value_norm"]
    assert [c.name for c in verify(a).checks if c.passed] == ["pattern", "output", "values", "heads", "gate", "residual"]
    with pytest.raises(UnsupportedArchitectureError, match="value norm 'v_norm'"):
        a.W_V(0)
    with pytest.raises(UnsupportedArchitectureError, match="value norm 'v_norm'"):
        headlab.attention_norms(model, IDS)
    # what serves: captures equal the model's own maps and values, gates, a backend, pruning
    with torch.no_grad():
        out = model(**IDS, output_attentions=True)
    cache = headlab.capture(model, IDS, ["blocks.1.attn.pattern", "blocks.1.attn.v"])
    torch.testing.assert_close(cache["blocks.1.attn.pattern"], out.attentions[1], atol=1e-6, rtol=1e-5)
    attn = model.model.layers[1].self_attn
    W, b = a.value_projection(1)
    raw = torch.einsum("ble,hed->bhld", a.blocks[1].input_layernorm(_stream_into(model, 1)), W)
    torch.testing.assert_close(cache["blocks.1.attn.v"], attn.v_norm(raw), atol=1e-5, rtol=1e-4)
    with a.use_backend("tiled"), torch.no_grad():
        torch.testing.assert_close(model(**IDS).logits, out.logits, atol=1e-5, rtol=1e-4)
    a.gates[1, 2] = 0.0
    with torch.no_grad():
        gated = model(**IDS).logits
    a.reset_gates()
    assert not torch.allclose(gated, out.logits)
    ro = headlab.rollout(model, IDS)  # rollout reads the maps alone: the model's own, chained
    R = None
    for P in out.attentions:
        Ah = 0.5 * P[0].double().mean(0) + 0.5 * torch.eye(P.shape[-1], dtype=torch.float64)
        Ah = Ah / Ah.sum(-1, keepdim=True)
        R = Ah if R is None else Ah @ R
    torch.testing.assert_close(ro.maps[-1].double(), R, atol=1e-5, rtol=1e-5)
    pruned = headlab.prune_heads(model, {1: [2]})
    with torch.no_grad():
        torch.testing.assert_close(pruned.model(**IDS).logits, gated, atol=1e-5, rtol=1e-4)


def _stream_into(model, layer):
    got = {}
    h = model.model.layers[layer].register_forward_pre_hook(
        lambda m, args, kw: got.__setitem__("x", (args[0] if args else kw["hidden_states"]).detach()), with_kwargs=True)
    try:
        with torch.no_grad():
            model(**IDS)
    finally:
        h.remove()
    return got["x"]


def test_a_value_norm_over_all_heads_is_refused_as_mixing_heads():
    with pytest.raises(UnsupportedArchitectureError, match="value norm 'v_norm'.*mixes heads"):
        headlab.models.adapt(_vnorm_model(across=True))


def test_a_sub_norm_over_all_heads_before_the_output_projection_is_refused_naming_it():
    model = A._auto("bitnet", pad_token_id=0, eos_token_id=2, bos_token_id=1)().eval()
    with pytest.raises(UnsupportedArchitectureError, match="sub-norm 'self_attn.attn_sub_norm'"):
        headlab.models.adapt(model)


@pytest.mark.parametrize("kind", ["local", "transient-global"])
def test_longt5_blocked_attention_is_refused_with_its_reason(kind):
    model = A._auto("longt5", num_decoder_layers=A.LAYERS, d_kv=A.D, d_ff=A.FF, relative_attention_num_buckets=8,
                    decoder_start_token_id=0, pad_token_id=0, encoder_attention_type=kind, local_radius=2,
                    global_block_size=4)().eval()
    with pytest.raises(UnsupportedArchitectureError, match="local / transient-global attention over blocks") as e:
        headlab.models.adapt(model)
    assert "block length" in str(e.value) and isinstance(e.value, HeadlabError)
