"""Model adapters: per-family parity on tiny random-initialised configs (no downloads).

For every family: the adapter's weight views reproduce the model's q/k/v, capture equals Hugging
Face's ``output_attentions`` on the eager path, a gate of 0 equals zeroing the head's W^O slice,
and the model's outputs on headlab backends equal the eager outputs.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import headlab
from headlab.attention import backends as hb
from headlab.errors import ConfigError, ModelError, UnknownBackendError, UnsupportedArchitectureError
from headlab.models import adapt
from headlab.models.transformer import Transformer, TransformerConfig

V, E, L, LAYERS = 97, 32, 11, 2


def _bert():
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=V, hidden_size=E, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, attn_implementation="eager"))


def _roberta():
    return transformers.RobertaModel(transformers.RobertaConfig(
        vocab_size=V, hidden_size=E, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=66, pad_token_id=1, attn_implementation="eager"))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=E, n_layer=LAYERS, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager"))


def _llama():  # grouped-query attention: 4 query heads share 2 kv heads
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=E, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, attn_implementation="eager"))


def _smollm2_layout():  # SmolLM2-135M's head layout (9 query heads on 3 kv heads), tiny widths
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=72, num_hidden_layers=LAYERS, num_attention_heads=9, num_key_value_heads=3,
        head_dim=8, intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=True,
        attn_implementation="eager"))


def _mistral():  # GQA and a sliding window shorter than the input
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=V, hidden_size=E, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=64, max_position_embeddings=64, sliding_window=5, attn_implementation="eager"))


def _qwen2():  # GQA with biases on q, k, v
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=V, hidden_size=E, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, attn_implementation="eager"))


def _headlab_encoder():
    return Transformer(TransformerConfig(vocab_size=V, d_model=E, n_layers=LAYERS, n_heads=4, causal=False))


def _headlab_decoder():
    return Transformer(TransformerConfig(vocab_size=V, d_model=E, n_layers=LAYERS, n_heads=4, n_kv_heads=2,
                                         causal=True))


# name -> (builder, family, output field compared, uses rotary embeddings)
FAMILY_CASES = {
    "bert": (_bert, "bert", "last_hidden_state", False),
    "roberta": (_roberta, "bert", "last_hidden_state", False),
    "gpt2": (_gpt2, "gpt2", "logits", False),
    "llama": (_llama, "llama", "logits", True),
    "smollm2-layout": (_smollm2_layout, "llama", "logits", True),
    "mistral": (_mistral, "llama", "logits", True),
    "qwen2": (_qwen2, "llama", "logits", True),
    "headlab-encoder": (_headlab_encoder, "headlab", "logits", False),
    "headlab-decoder": (_headlab_decoder, "headlab", "logits", False),
}
CASE_NAMES = list(FAMILY_CASES)

# backends the swap must agree on with eager (all three built in, so always registered)
SWAP_BACKENDS = ["reference", "sdpa", "tiled"]


def _build(name: str):
    torch.manual_seed(0)
    model = FAMILY_CASES[name][0]().eval()
    with torch.no_grad():  # non-trivial biases and norms, so that every weight view matters
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n.lower() or n.endswith(("ln_1.weight", "ln_2.weight")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _inputs(padded: bool = True):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, V, (2, L), generator=g)
    mask = torch.ones(2, L, dtype=torch.long)
    if padded:
        mask[1, 7:] = 0  # right padding: every real query still sees a key
    return {"input_ids": ids, "attention_mask": mask}


def _out(model, inputs, field, **kw):
    out = model(**inputs, **kw)
    return getattr(out, field), out


@pytest.fixture(scope="module")
def models():
    return {name: _build(name) for name in CASE_NAMES}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_weight_views_reproduce_qkv(models, name):
    model = models[name]
    a = adapt(model)
    assert a.family == FAMILY_CASES[name][1]
    inputs = _inputs(padded=False)
    seen = {}

    def grab(module, args, kwargs):
        seen.setdefault(module._headlab.layer, args[0] if args else (kwargs.get("hidden_states", kwargs.get("x"))))

    hooks = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in a.attn_modules]
    try:
        cache = headlab.capture(model, inputs, ["blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v"])
    finally:
        for h in hooks:
            h.remove()
    for layer in range(a.n_layers):
        x = seen[layer]  # (B, L, E): what the projections read
        proj = {}
        for which, W, b in (("q", a.W_Q, a.b_Q), ("k", a.W_K, a.b_K), ("v", a.W_V, a.b_V)):
            y = torch.einsum("ble,hed->bhld", x, W(layer))  # (B, heads, L, d)
            bias = b(layer)
            proj[which] = y if bias is None else y + bias[None, :, None, :]
        if FAMILY_CASES[name][3]:  # rotary: q, k are captured after RoPE, so apply it to the projections
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            pos = torch.arange(L)[None]
            cos, sin = model.model.rotary_emb(x, pos)
            proj["q"], proj["k"] = apply_rotary_pos_emb(proj["q"], proj["k"], cos, sin)
        for which in "qkv":
            got = cache[f"blocks.{layer}.attn.{which}"]
            heads = a.n_heads if which == "q" else a.n_kv_heads
            assert got.shape == (2, heads, L, a.head_dim)
            torch.testing.assert_close(got, proj[which], atol=1e-5, rtol=1e-5)
    assert a.W_O(0).shape == (a.n_heads, a.head_dim, a.d_model)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_capture_pattern_equals_output_attentions(models, name):
    model = models[name]
    inputs = _inputs()
    with torch.no_grad():
        _, ref = _out(model, inputs, FAMILY_CASES[name][2], output_attentions=True)
    cache = headlab.capture(model, inputs, "blocks.*.attn.pattern")
    real = inputs["attention_mask"].bool()[:, None, :, None]  # (B, 1, L, 1): real query rows
    assert len(ref.attentions) == LAYERS
    for layer in range(LAYERS):
        got = cache[f"blocks.{layer}.attn.pattern"]
        assert got.shape == ref.attentions[layer].shape
        torch.testing.assert_close(got.masked_fill(~real, 0), ref.attentions[layer].masked_fill(~real, 0),
                                   atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_gate_zero_equals_zeroed_wo_slice(models, name):
    model = models[name]
    field = FAMILY_CASES[name][2]
    inputs = _inputs()
    layer, head = 1, 2
    a = adapt(model)
    twin = _build(name)  # same seed: the same weights
    with torch.no_grad():
        base, _ = _out(model, inputs, field)
        a.gates[layer, head] = 0.0
        try:
            gated, _ = _out(model, inputs, field)
        finally:
            a.reset_gates()
        adapt(twin).W_O(layer)[head].zero_()  # the view edits the twin's output projection
        zeroed, _ = _out(twin, inputs, field)
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(gated[real], zeroed[real], atol=1e-5, rtol=1e-5)
    assert (gated - base)[real].abs().max() > 1e-4  # the head mattered


@pytest.mark.parametrize("name", CASE_NAMES)
def test_backend_swap_parity(models, name):
    model = models[name]
    field = FAMILY_CASES[name][2]
    inputs = _inputs()
    real = inputs["attention_mask"].bool()
    a = adapt(model)
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    with torch.no_grad():
        ref, _ = _out(model, inputs, field)  # HF eager (headlab's own model: its default backend)
        for backend in SWAP_BACKENDS:
            with a.use_backend(backend):
                got, _ = _out(model, inputs, field)
            torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=1e-5, msg=f"{name} on {backend}")
    assert getattr(getattr(model, "config", None), "_attn_implementation", None) == impl  # restored
    assert a.backend is None


def test_swap_really_runs_headlab(models, monkeypatch):
    """The swap must route through headlab's backend, not silently stay on eager."""
    model = models["llama"]
    calls = []
    sdpa = hb.get("sdpa")
    orig = type(sdpa).forward

    def spy(self, q, k, v, spec, **kw):
        calls.append((spec.heads, spec.kv_heads))
        return orig(self, q, k, v, spec, **kw)

    monkeypatch.setattr(type(sdpa), "forward", spy)
    with torch.no_grad(), adapt(model).use_backend("sdpa"):
        model(**_inputs())
    assert calls == [(4, 2)] * LAYERS  # GQA kept: no repeat_kv copy


def test_gates_are_differentiable():
    model = _build("headlab-decoder").double()
    a = adapt(model)
    ids = _inputs(padded=False)["input_ids"]
    a.gates = torch.ones(LAYERS, 4, dtype=torch.float64).requires_grad_(True)
    model(ids).logits[0, -1, 3].backward()
    grad = a.gates.grad[1, 2].item()
    eps = 1e-6
    vals = []
    for s in (1, -1):
        with torch.no_grad():
            g = torch.ones(LAYERS, 4, dtype=torch.float64)
            g[1, 2] += s * eps
            a.gates = g
            vals.append(model(ids).logits[0, -1, 3].item())
    a.reset_gates()
    assert grad == pytest.approx((vals[0] - vals[1]) / (2 * eps), rel=1e-5, abs=1e-9)


def test_gates_shape_and_layer_checked(models):
    a = adapt(models["bert"])
    with pytest.raises(ConfigError, match="shape"):
        a.gates = torch.ones(3, 3)
    with pytest.raises(ConfigError, match="out of range"):
        a.W_Q(LAYERS)
    with pytest.raises(UnknownBackendError, match="known backends"):
        with a.use_backend("no-such-backend"):
            pass
    assert adapt(models["bert"]) is a  # cached
    assert [s for s in a.hook_sites() if s.startswith("blocks.1.")] == [
        f"blocks.1.attn.{k}" for k in ("q", "k", "v", "pattern", "z", "head_out", "stats")]


def test_unsupported_architecture():
    latent = transformers.DeepseekV3Model(transformers.DeepseekV3Config(  # an architecture headlab refuses
        vocab_size=V, hidden_size=E, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1))
    for model in (latent, torch.nn.Linear(3, 3)):
        with pytest.raises(UnsupportedArchitectureError, match="bert.*gpt2.*llama"):
            adapt(model)


def test_own_transformer_trains_saves_and_loads(tmp_path):
    model = _build("headlab-decoder").train()
    ids = _inputs(padded=False)["input_ids"]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    model.eval()
    model.save(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "headlab_config.json").read_text())["causal"] is True
    loaded = headlab.load(tmp_path / "m")
    assert loaded.family == "headlab" and loaded.tokenizer is None and loaded.max_positions == 128
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, model(ids).logits, atol=0, rtol=0)
    with pytest.raises(ModelError, match="no tokenizer"):
        loaded.encode("hello")
    with pytest.raises(ConfigError):
        TransformerConfig(d_model=30, n_heads=4)


def test_load_errors(tmp_path):
    with pytest.raises(ModelError, match="known names: minilm"):
        headlab.load("no-such-model")
    with pytest.raises(ModelError, match="not a Hugging Face model folder"):
        headlab.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    with pytest.raises(UnsupportedArchitectureError, match="supported families"):
        headlab.load(tmp_path)


def test_load_local_hf_folder(tmp_path, models):
    models["gpt2"].save_pretrained(tmp_path)
    loaded = headlab.load(tmp_path)
    assert (loaded.family, loaded.max_positions, loaded.tokenizer) == ("gpt2", 64, None)
    ids = _inputs(padded=False)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, models["gpt2"](ids).logits)
