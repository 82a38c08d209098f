"""Attention computed in a module's own math (issue: any model, round two), read through the bridge
(:mod:`headlab.models.hf.own_bridge`): four remote-code-style decoders (``own_models``) through every step of
``test_architectures.test_every_step``, the pattern checked against an independent computation from the module's
weights, the model's own path untouched, and what the bridge cannot follow refused naming the op."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import headlab
from headlab.errors import UnsupportedArchitectureError
from headlab.models import adapt
from headlab.models.hf.own_bridge import bridge_of
from headlab.models.hf.own_math import Interceptor

import architectures as A
import own_models as O
import test_architectures as TA

MATH = ["packed_grouped", "w_pack", "nanogpt"]  # return their weights (output_attentions)


@pytest.fixture
def registered():
    """The styles as sweep entries of ``architectures`` for the length of one test."""
    names = {f"own_{s}": (lambda s=s: O.build(s), "text") for s in O.STYLES}
    A.BUILDERS.update(names)
    yield
    for n in names:
        A.BUILDERS.pop(n)


@pytest.mark.parametrize("style", ["packed_grouped"])
def test_every_step_on_remote_code_style(style, registered, tmp_path, sweep):
    cache: dict = {}

    def built(name):
        if name not in cache:
            cache[name] = A.build(name)
        return cache[name]

    TA.test_every_step(f"own_{style}", built, tmp_path, sweep)


def _reference_pattern(model, style: str, x: dict) -> list[torch.Tensor]:
    """Each layer's weights from its own projections, written here from the style's definition."""
    seen: list[torch.Tensor] = []
    hs = [b.attn.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach())) for b in model.transformer.h]
    with torch.no_grad():
        model(**x)
    for h in hs:
        h.remove()
    keep = torch.ones(x["input_ids"].shape[1], x["input_ids"].shape[1], dtype=torch.bool).tril()[None, None]
    keep = keep & x["attention_mask"].bool()[:, None, None, :]
    out = []
    for block, h in zip(model.transformer.h, seen):
        at = block.attn
        B, L, E = h.shape
        if style == "packed_grouped":
            r = at.num_key_value_groups
            w = at.wqkv.weight.view(at.num_key_value_heads, r + 2, O.D, E)
            q = torch.einsum("ble,grde->bgrld", h, w[:, :r]).reshape(B, at.num_heads, L, O.D)
            k = torch.einsum("ble,gde->bgld", h, w[:, r]).repeat_interleave(r, 1)
            pos = torch.arange(L)
            q, k = O._rotary(q, pos), O._rotary(k, pos)
        else:
            lin = at.W_pack if style == "w_pack" else at.c_attn
            qkv = F.linear(h, lin.weight, lin.bias)
            q, k = (t.view(B, L, O.H, O.D).transpose(1, 2) for t in qkv.split(E, -1)[:2])
        s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(O.D)
        out.append(torch.softmax(s.masked_fill(~keep, float("-inf")), -1))
    return out


@pytest.mark.parametrize("style", MATH)
def test_pattern_equals_its_definition(style):
    model = O.build(style)
    x = O.inputs()
    a = adapt(model)
    got = headlab.capture(model, x, a.sites("pattern"))
    for layer, ref in enumerate(_reference_pattern(model, style, x)):
        mine = got[a.site_name(layer, "pattern")].double()
        real = x["attention_mask"].bool()
        torch.testing.assert_close(mine.movedim(2, 1)[real], ref.movedim(2, 1)[real], atol=1e-6, rtol=1e-6)


def test_grouped_heads_are_read_unrepeated():
    model = O.build("packed_grouped")
    a = adapt(model)
    assert (a.n_heads, a.n_kv_heads) == (4, 2)
    assert bridge_of(model).repeats == {f"transformer.h.{i}.attn": 2 for i in range(2)}
    W = model.transformer.h[0].attn.wqkv.weight.view(2, 4, O.D, O.E)  # (group, r q heads + k + v, d, E)
    torch.testing.assert_close(a.W_V(0).detach().reshape(2, O.D, O.E) if a.W_V(0).shape[-1] == O.E
                               else a.W_V(0).detach().transpose(-1, -2).reshape(2, O.D, O.E), W[:, 3])


def test_sdpa_called_directly_is_served_and_checked_without_weights(tmp_path):
    model = O.build("sdpa_direct")
    x = O.inputs()
    with torch.no_grad():
        ref = model(**x).logits
    a = adapt(model)  # the load-time check rebuilds z = sum_k P v (no output_attentions) against W^O's input
    assert bridge_of(model).kinds == {f"transformer.h.{i}.attn": "sdpa" for i in range(2)}
    for backend in TA.BACKENDS:
        with a.use_backend(backend), torch.no_grad():
            out = model(**x).logits
        torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[1, :7], ref[1, :7], atol=1e-5, rtol=1e-5)
    model.save_pretrained(tmp_path)
    loaded = headlab.load(tmp_path)
    assert bridge_of(loaded.model) is not None and loaded.adapter.n_layers == 2


@pytest.mark.parametrize("style", ["w_pack", "nanogpt"])
def test_served_and_pruning_refused(style):
    """nanoGPT's forward takes its head size from the input's width (``C // n_head``) and Baichuan's splits ``W_pack``
    by ``hidden_size``, which removing heads does not change: gates, captures and backends serve them; physical
    removal is refused, found on the pruned copy (it must equal the gated original)."""
    from headlab.errors import PruneError

    model = O.build(style)
    x = O.inputs()
    with torch.no_grad():
        eager = model(**x, output_attentions=True)
    a = adapt(model)
    got = headlab.capture(model, x, a.sites("pattern"))
    real = x["attention_mask"].bool()
    for layer in range(2):
        torch.testing.assert_close(got[a.site_name(layer, "pattern")].movedim(2, 1)[real],
                                   eager.attentions[layer].movedim(2, 1)[real], atol=1e-6, rtol=1e-6)
    for backend in TA.BACKENDS:
        with a.use_backend(backend), torch.no_grad():
            torch.testing.assert_close(model(**x).logits[real], eager.logits[real], atol=1e-5, rtol=1e-5)
    a.gates[1, 2] = 0.0
    wo = a.W_O(1)
    with torch.no_grad():
        gated = model(**x).logits
        a.reset_gates()
        saved = wo[2].detach().clone()
        wo[2] = 0.0
        zeroed = model(**x).logits
        wo[2] = saved
    torch.testing.assert_close(gated, zeroed, atol=1e-6, rtol=1e-6)
    with pytest.raises(PruneError, match="reads a head count or width headlab cannot change"):
        headlab.prune_heads(model, {0: [1]})


def test_the_models_own_path_is_untouched():
    model = O.build("nanogpt")
    x = O.inputs()
    with torch.no_grad():
        before = model(**x, output_attentions=True)
    adapt(model)
    with torch.no_grad():
        after = model(**x, output_attentions=True)  # eager: the hooks do nothing
    assert torch.equal(before.logits, after.logits)
    assert all(torch.equal(p, q) for p, q in zip(before.attentions, after.attentions))


def test_the_scores_are_never_computed_on_a_headlab_backend():
    """Deferred: q k^T, the masked scores and the weights are zero-strided placeholders, never n x n tensors."""
    model = O.build("nanogpt")
    a = adapt(model)
    sizes: list[int] = []
    at = model.transformer.h[0].attn
    orig = Interceptor._attention

    def spy(self, func, args, c):
        sizes.append(args[0].untyped_storage().nbytes())
        return orig(self, func, args, c)

    Interceptor._attention = spy
    try:
        with a.use_backend("tiled"), torch.no_grad():
            model(**O.inputs())
    finally:
        Interceptor._attention = orig
    assert sizes and max(sizes) <= 8, sizes  # one element, expanded
    assert at.n_head == 4


class _Capped(nn.Module):
    """A module that soft-caps its scores (tanh), which one attention call cannot express."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (p(x).view(B, L, 2, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        s = torch.tanh(q @ k.transpose(-1, -2) / 5.0) * 5.0
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(B, L, 8))


def test_an_op_it_cannot_follow_is_named():
    from headlab.models.hf.own_bridge import bridge

    model = nn.Sequential(_Capped())
    with pytest.raises(UnsupportedArchitectureError, match="tanh"):
        bridge(model, {"input": torch.randn(1, 5, 8)}, "capped")


def test_interceptor_follows_a_batch_folded_softmax():
    """(B * H, L, d) math (XGLM, DeBERTa-v2): the attention handed on is (B, H, L, d) and the output folds back."""
    torch.manual_seed(0)
    B, H, L, d = 2, 3, 5, 4
    q, k, v = (torch.randn(B * H, L, d) for _ in range(3))
    mask = torch.zeros(B, 1, L, L)
    mask[1, ..., 3:] = torch.finfo(torch.float32).min
    seen = {}

    def attend(q4, k4, v4, m, *, scaling, dropout, is_causal):
        seen.update(q=q4.shape, scale=scaling, mask=m)
        p = torch.softmax(q4 @ k4.transpose(-1, -2) * scaling + m, -1)
        return p @ v4, p

    def own(q, k, v):
        s = torch.bmm(q, k.transpose(1, 2)) * 0.5
        s = s.view(B, H, L, L) + mask
        s = torch.max(s, torch.full((), torch.finfo(s.dtype).min))
        p = F.softmax(s.view(B * H, L, L), dim=-1)
        return torch.bmm(p, v)

    with Interceptor(attend, defer=True, heads=H):
        out = own(q, k, v)
    torch.testing.assert_close(out, own(q, k, v))
    assert seen["q"] == (B, H, L, d) and seen["scale"] == 0.5 and bool(torch.isinf(seen["mask"][1, 0, 0, 3:]).all())


def test_a_declared_family_pinned_to_eager_is_refused_not_silently_eager():
    """transformers keeps a class whose file writes attention by hand on eager (``_can_set_attn_implementation``);
    a backend swap that transformers ignores would leave headlab's backends, gates and captures unrun."""
    import transformers as T

    class PinnedLlama(T.LlamaForCausalLM):
        @classmethod
        def _can_set_attn_implementation(cls):
            return False

    cfg = T.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=64, attn_implementation="eager")
    a = adapt(PinnedLlama(cfg).eval())
    with pytest.raises(UnsupportedArchitectureError, match="_can_set_attn_implementation = classmethod"):
        with a.use_backend("tiled"):
            pass
    with pytest.raises(UnsupportedArchitectureError, match="keeps PinnedLlama on its 'eager' attention"):
        headlab.capture(a.model, {"input_ids": torch.tensor([[1, 2, 3]])}, a.sites("pattern"))


def test_models_check_says_the_attention_is_read_through_its_own_math(tmp_path):
    import json

    from typer.testing import CliRunner

    from headlab.cli.main import app

    O.build("packed_grouped").save_pretrained(tmp_path)
    r = CliRunner().invoke(app, ["models", "--check", str(tmp_path)])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())  # the console wraps long lines at its width
    assert "attention computed in 2 modules' own math (softmax(q k^T) v written out)" in said
    assert "keys and values repeated 2x by the module, read unrepeated" in said
    j = json.loads(CliRunner().invoke(app, ["models", "--check", str(tmp_path), "--json"]).output)
    assert j["own_math"]["repeats"] == {f"transformer.h.{i}.attn": 2 for i in range(2)}


def _twins():
    """The same tiny Llama twice, equal weights: transformers' LlamaAttention (the interface) and an attention module
    that computes ``softmax(q k^T c + mask) v`` itself (read through the bridge)."""
    import transformers as T
    from transformers.models.llama import modeling_llama as ML

    class OwnAttention(ML.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kw):
            B, n, _ = hidden_states.shape
            shape = (B, n, -1, self.head_dim)
            q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
            k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
            v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
            q, k = ML.apply_rotary_pos_emb(q, k, *position_embeddings)
            k, v = ML.repeat_kv(k, self.num_key_value_groups), ML.repeat_kv(v, self.num_key_value_groups)
            s = torch.matmul(q, k.transpose(2, 3)) * self.scaling
            if attention_mask is not None:
                s = s + attention_mask
            p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            return self.o_proj(torch.matmul(p, v).transpose(1, 2).reshape(B, n, -1)), p

    class TwinConfig(T.LlamaConfig):
        model_type = "own_llama_twin"

    class TwinLlama(T.LlamaForCausalLM):
        config_class = TwinConfig

    kw = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(T.LlamaConfig(**kw)).eval()
    own = TwinLlama(TwinConfig(**kw)).eval()
    own.load_state_dict(ref.state_dict())
    for layer in own.model.layers:
        layer.self_attn.__class__ = OwnAttention
    return ref, own


def test_through_the_bridge_the_numbers_are_the_interfaces():
    """Flow, patching, importance, the atlas and ablation (beside what the sweep checks) give the same
    numbers on a model read through its own math as on its twin that calls the interface."""
    ref, own = _twins()
    a_ref, a_own = adapt(ref), adapt(own)
    assert bridge_of(own) is not None and bridge_of(ref) is None and a_own.n_kv_heads == 2
    g = torch.Generator().manual_seed(5)
    clean = {"input_ids": torch.randint(2, 97, (1, 9), generator=g)}
    bad = {"input_ids": torch.randint(2, 97, (1, 9), generator=g)}

    def metric(logits):
        return logits[:, -1, 5] - logits[:, -1, 6]

    for fn in (lambda m: headlab.attention_flow(m, clean, source=0).values,
               lambda m: headlab.patch(m, clean, bad, metric, sites="z").raw["z"],
               lambda m: headlab.head_importance(m, [clean["input_ids"][0], bad["input_ids"][0]], batch_size=2)):
        torch.testing.assert_close(fn(own), fn(ref), atol=1e-5, rtol=1e-5)
    texts = [clean["input_ids"][0], bad["input_ids"][0]]
    at = [headlab.atlas(m, kinds=["previous_token", "induction"], copying=False, n_repeated=2, max_tokens=16,
                        checks=False) for m in (own, ref)]
    assert sorted(at[0].scores) == ["induction", "previous_token"]
    for kind in at[0].scores:
        torch.testing.assert_close(torch.as_tensor(at[0].scores[kind]), torch.as_tensor(at[1].scores[kind]),
                                   atol=1e-5, rtol=1e-5)
    ab = [headlab.ablate(m, texts, n_boot=20, k=2, batch_size=2, seed=0) for m in (own, ref)]
    for field in ("baseline", "single", "keep_one", "pair_effect"):
        torch.testing.assert_close(torch.as_tensor(getattr(ab[0], field)), torch.as_tensor(getattr(ab[1], field)),
                                   atol=1e-5, rtol=1e-5, equal_nan=True)


def test_a_second_instance_of_a_bridged_type_is_bridged_too():
    """The view found for a config is cached: a later instance (a new class object of the same name, another dtype)
    must get the bridge too, else the model's own math would run beside headlab's masks, silently wrong."""
    for dtype in (torch.float32, torch.bfloat16):
        ref, own = _twins()
        ref, own = ref.to(dtype), own.to(dtype)
        a_ref, a_own = adapt(ref), adapt(own)
        assert bridge_of(own) is not None
        x = {"input_ids": torch.randint(2, 97, (2, 13)), "attention_mask": torch.tensor([[1] * 13, [1] * 9 + [0] * 4])}
        keep = x["attention_mask"].bool()
        with torch.no_grad(), a_ref.use_backend("tiled"):
            want = ref(**x).logits
        with torch.no_grad(), a_own.use_backend("tiled"):
            got = own(**x).logits
        torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
