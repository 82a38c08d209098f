"""Edits at hook sites (adapter.hooks, capture(edits=)), one gate per head, the family registry."""

from __future__ import annotations

import pytest
import torch
import transformers

import headlab
from headlab.errors import ConfigError, ShapeError, SiteError, UnsupportedArchitectureError
from headlab.models import adapt
from headlab.models.transformer import Transformer, TransformerConfig

V, E, L = 61, 32, 9


def _bert():
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(
        vocab_size=V, hidden_size=E, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, attn_implementation="eager")).eval()


def _llama():  # 4 query heads on 2 kv heads
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=E, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")).eval()


def _decoder():
    torch.manual_seed(0)
    return Transformer(TransformerConfig(vocab_size=V, d_model=E, n_layers=2, n_heads=4, n_kv_heads=2,
                                         causal=True)).eval()


def _ids():
    return torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(3))


def _out(m, ids):
    o = m(ids)
    return o.logits if hasattr(o, "logits") and o.logits is not None else o.last_hidden_state


BUILDERS = {"bert": _bert, "llama": _llama, "headlab": _decoder}


def _zero_head(h):
    def fn(t, site):
        t = t.clone()
        t[:, h] = 0
        return t
    return fn


@pytest.mark.parametrize("family", list(BUILDERS))
@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
@pytest.mark.parametrize("kind", ["z", "head_out"])
def test_zeroing_a_head_equals_gate_zero_on_every_backend(family, backend, kind):
    m, ids = BUILDERS[family](), _ids()
    a = adapt(m)
    with a.use_backend(backend), a.hooks({f"blocks.1.attn.{kind}": _zero_head(2)}):
        edited = _out(m, ids)
    a.gates[1, 2] = 0.0
    with a.use_backend(backend):
        gated = _out(m, ids)
    a.reset_gates()
    with a.use_backend(backend):
        plain = _out(m, ids)
    torch.testing.assert_close(edited, gated, atol=1e-5, rtol=1e-5)
    assert (edited - plain).abs().max() > 1e-4  # the edit did something


@pytest.mark.parametrize("family", list(BUILDERS))
def test_replacing_the_pattern_by_itself_changes_nothing(family):
    m, ids = BUILDERS[family](), _ids()
    a = adapt(m)
    with a.use_backend("sdpa"):
        plain = _out(m, ids)
    seen = []

    def same(p, site):
        seen.append(site)
        return p.clone()

    with a.hooks({"blocks.*.attn.pattern": same}):
        edited = _out(m, ids)
    torch.testing.assert_close(edited, plain, atol=1e-5, rtol=1e-5)
    assert seen == ["blocks.0.attn.pattern", "blocks.1.attn.pattern"]


def test_a_pattern_edit_runs_the_layer_from_the_edited_map():
    """Uniform attention over the visible keys: the layer's z is the running mean of v (causal decoder)."""
    m, ids = _decoder(), _ids()
    a = adapt(m)

    def uniform(p, site):
        vis = (p > 0).to(p.dtype)
        return vis / vis.sum(-1, keepdim=True)

    cache = headlab.capture(m, ids, ["blocks.0.attn.v", "blocks.0.attn.z", "blocks.0.attn.pattern"],
                            edits={"blocks.0.attn.pattern": uniform})
    v = cache["blocks.0.attn.v"].repeat_interleave(2, dim=1)  # (B, H, L, d): query head h reads kv head h // 2
    running_mean = v.cumsum(2) / torch.arange(1, L + 1).view(1, 1, L, 1)
    torch.testing.assert_close(cache["blocks.0.attn.z"], running_mean, atol=1e-5, rtol=1e-5)
    pat = cache["blocks.0.attn.pattern"]
    torch.testing.assert_close(pat.sum(-1), torch.ones_like(pat.sum(-1)))
    assert not a.attn_modules[0]._headlab.edits  # removed after the capture


def test_q_edit_and_nested_hooks_apply_in_order():
    m, ids = _decoder(), _ids()
    a = adapt(m)
    order = []

    def first(t, site):
        order.append("first")
        return t * 2

    def second(t, site):
        order.append("second")
        return t + 1

    with a.hooks({"blocks.0.attn.q": first}):
        with a.hooks({"blocks.0.attn.q": second}):
            c = headlab.capture(m, ids, "blocks.0.attn.q")
    ref = headlab.capture(m, ids, "blocks.0.attn.q")
    torch.testing.assert_close(c["blocks.0.attn.q"], ref["blocks.0.attn.q"] * 2 + 1)
    assert order == ["first", "second"]


def test_wrong_shape_is_a_typed_error_naming_site_and_shapes_and_hooks_are_removed():
    m, ids = _bert(), _ids()
    a = adapt(m)
    with pytest.raises(ShapeError, match=r"blocks\.0\.attn\.z.*\(2, 4, 8, 8\).*\(2, 4, 9, 8\)"):
        with a.hooks({"blocks.0.attn.z": lambda z, site: z[:, :, 1:]}):
            m(ids)
    assert all(not am._headlab.edits for am in a.attn_modules)
    assert m.config._attn_implementation == "eager"  # the implementation switched back
    with pytest.raises(SiteError, match="matches nothing"):
        with a.hooks({"blocks.0.attn.stats": lambda t, s: t}):
            pass
    with pytest.raises(ConfigError, match="not a function"):
        with a.hooks({"blocks.0.attn.z": 3}):
            pass


def test_one_gate_per_head_on_headlabs_transformer():
    m, ids = _decoder(), _ids()
    a = adapt(m)
    m.blocks[1].attn.head_gate[3] = 0.0  # the module's gate is the adapter's
    assert a.gates[1, 3] == 0.0
    with_module_gate = _out(m, ids)
    a.reset_gates()
    assert m.blocks[1].attn.head_gate[3] == 1.0
    a.gates = torch.ones(2, 4).index_put_((torch.tensor([1]), torch.tensor([3])), torch.tensor(0.0))
    torch.testing.assert_close(_out(m, ids), with_module_gate)
    a.reset_gates()
    cache = headlab.capture(m, ids, "blocks.1.attn.head_out")
    a.gates[1, 3] = 0.5  # applied once, not squared
    cache_half = headlab.capture(m, ids, "blocks.1.attn.head_out")
    torch.testing.assert_close(cache_half["blocks.1.attn.head_out"][:, 3], cache["blocks.1.attn.head_out"][:, 3] * 0.5)


def test_causal_comes_from_the_family():
    assert not adapt(_bert()).causal
    assert adapt(_llama()).causal
    assert adapt(_decoder()).causal
    enc = Transformer(TransformerConfig(vocab_size=V, d_model=E, n_layers=1, n_heads=4))
    assert not adapt(enc).causal


def test_registry_derives_types_messages_and_positions():
    from headlab.models.hf import FAMILIES, max_positions, supported_model_types, unsupported_message

    assert {"bert", "gpt2", "llama", "gemma", "falcon"} <= {f.family for f in FAMILIES}
    assert {"bert", "roberta", "gpt2", "llama", "mistral", "qwen2", "gemma2", "qwen3", "phi3"} <= set(supported_model_types())
    assert len(supported_model_types()) == len(set(supported_model_types()))
    msg = unsupported_message("deepseek_v3")
    assert "'deepseek_v3'" in msg and all(t in msg for t in supported_model_types())
    cfg = transformers.RobertaConfig(max_position_embeddings=66, pad_token_id=1)
    assert max_positions(cfg) == 64
    with pytest.raises(UnsupportedArchitectureError, match="deepseek_v3"):
        max_positions(transformers.DeepseekV3Config())


def test_integer_hf_mask_is_a_mask_error():
    from headlab.errors import MaskError
    from headlab.models.hf.attention_fn import hf_mask_to_bool

    with pytest.raises(MaskError, match="int64"):
        hf_mask_to_bool(torch.ones(1, 1, 2, 2, dtype=torch.long))


def test_stack_of_a_partial_capture_is_a_site_error():
    m, ids = _decoder(), _ids()
    cache = headlab.capture(m, ids, "blocks.0.attn.z")
    with pytest.raises(SiteError, match="1 of 2 layers"):
        cache.stack("z")


def _gemma2():  # soft-capped scores, a sliding window on alternate layers, GQA, query_pre_attn_scalar scaling
    torch.manual_seed(0)
    m = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, max_position_embeddings=64, sliding_window=4, attn_logit_softcapping=2.0,
        final_logit_softcapping=None, query_pre_attn_scalar=16, attn_implementation="eager")).eval()
    with torch.no_grad():  # scores of a few units, so that the cap at 2 bends them
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return m


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
def test_gemma2_soft_capping_runs_on_headlab_backends_and_equals_eager(backend):
    m, ids = _gemma2(), _ids()
    with torch.no_grad():
        eager = m(ids, output_attentions=True)
        a = adapt(m)
        assert a.family == "gemma" and a.n_kv_heads == 2
        with a.use_backend(backend):
            got = m(ids).logits
    torch.testing.assert_close(got, eager.logits, atol=1e-5, rtol=1e-5)
    cache = headlab.capture(m, ids, "blocks.*.attn.pattern")
    for layer in range(2):  # the captured maps are the soft-capped (and, in layer 0, windowed) ones
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.pattern"], eager.attentions[layer], atol=1e-6, rtol=1e-5)
    for layer in m.model.layers:  # without the cap the outputs differ: the cap is really applied
        layer.self_attn.attn_logit_softcapping = None
    with torch.no_grad(), a.use_backend(backend):
        uncapped = m(ids).logits
    assert (uncapped - eager.logits).abs().max() > 1e-3


def test_statistics_of_a_soft_capped_model_are_those_of_its_capped_maps():
    from headlab.errors import BackendUnsupportedError

    m, ids = _gemma2(), _ids()
    with torch.no_grad():
        maps = m(ids, output_attentions=True).attentions
    st = headlab.capture(m, ids, "blocks.*.attn.stats")
    for layer in range(2):
        p = maps[layer].double()
        ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
        torch.testing.assert_close(st[f"blocks.{layer}.attn.stats"].entropy.double(), ent, atol=2e-5, rtol=1e-4)
    # the map-free norm tiles do not apply a score modification: refused, never a different number
    with pytest.raises(BackendUnsupportedError, match="stream=False"):
        headlab.attention_norms(m, ids[:1], stream=True)
