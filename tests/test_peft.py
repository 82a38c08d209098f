"""PEFT LoRA models read through their base model's structure (headlab.models.hf.peft_lora).

Every number is held against a model the test merges itself: a plain copy of the base model whose targeted
projections carry ``W + (lora_alpha / r) * B @ A`` (transposed for GPT-2's Conv1D, ``fan_in_fan_out``), computed
here from the adapter's raw A and B, not by PEFT's merge nor by headlab. Tiny models from tests/architectures.py:
llama (a declared family, separate projections), gpt2 (declared, fused Conv1D) and qwen3_moe (read by structure).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from architectures import build, inputs

import headlab
from headlab.errors import ModelError, PruneError, UnsupportedArchitectureError
from headlab.models import adapt

peft = pytest.importorskip("peft")

TARGETS = {
    "llama": (["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"], False),
    "gpt2": (["c_attn", "c_proj"], True),  # attn.c_proj and mlp.c_proj: LoRA outside the attention too
    "qwen3_moe": (["q_proj", "k_proj", "v_proj", "o_proj"], False),
}
R, ALPHA = 4, 12  # scale 3.0


def _lora(name: str, *, zero_b: bool = False, **kw):
    """``(base copy, PEFT model)``: the base model before LoRA wraps it, and the model with a LoRA of random A and B
    (B = 0, PEFT's default initialisation, with ``zero_b``)."""
    model = build(name)
    base = copy.deepcopy(model)
    targets, fifo = TARGETS[name]
    torch.manual_seed(3)
    cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets, fan_in_fan_out=fifo,
                          init_lora_weights=True if zero_b else False, **kw)
    return base, peft.get_peft_model(model, cfg).eval()


def _merged_by_hand(base, pm):
    """The base copy with every LoRA layer's effective weight ``W + alpha / r * B @ A`` written in."""
    merged = copy.deepcopy(base)
    mods = dict(merged.named_modules())
    n = 0
    for path, m in pm.get_base_model().named_modules():
        if isinstance(m, peft.tuners.lora.layer.Linear):
            A, B = m.lora_A["default"].weight.detach(), m.lora_B["default"].weight.detach()
            delta = (ALPHA / R) * (B @ A)  # (out, in)
            w = mods[path].weight
            with torch.no_grad():
                w.add_(delta.T if m.fan_in_fan_out else delta)
            n += 1
    assert n > 0
    return merged


def _main(out):
    return out.logits if getattr(out, "logits", None) is not None else out[0]


def _weights(a):
    return {(w, l): getattr(a, w)(l).detach() for l in range(a.n_layers) for w in ("W_Q", "W_K", "W_V", "W_O")}


@pytest.mark.parametrize("name", list(TARGETS))
def test_weights_patterns_and_check_equal_the_merged_model(name):
    base, pm = _lora(name)
    merged = _merged_by_hand(base, pm)
    if name == "qwen3_moe":  # found by structure on the module tree with the LoRA layers in it, not from a cache
        from headlab.models.hf import structure

        structure._FOUND.clear()
    a, m = adapt(pm), adapt(merged)
    assert getattr(a, "lora", False) and a.family == m.family
    assert adapt(pm.get_base_model()) is a and adapt(pm.base_model) is a and a.peft is pm
    if name == "qwen3_moe":
        found = a.found.summary()["blocks"]
        assert (found["projections"], found["out"]) == ("separate(q_proj, k_proj, v_proj)", "self_attn.o_proj")
    # per-head weights: the adapter's deltas included, equal to the hand-merged model's
    mine, want = _weights(a), _weights(m)
    for key, w in want.items():
        torch.testing.assert_close(mine[key], w, atol=1e-6, rtol=1e-6, msg=lambda s, key=key: f"{key}: {s}")
    assert any(not torch.equal(mine[k], v) for k, v in _weights(adapt(base)).items())  # the LoRA changed them
    assert (mine[("W_Q", 0)] - _weights(adapt(base))[("W_Q", 0)]).abs().max() > 1e-3
    # captured patterns equal the merged model's eager output_attentions; the outputs agree
    x = inputs(name)
    with torch.no_grad():
        eager = merged(**x, output_attentions=True)
        own = pm(**x)
    torch.testing.assert_close(_main(own), _main(eager), atol=1e-5, rtol=1e-5)
    cache = headlab.capture(pm, x, a.sites("pattern"))
    real = x["attention_mask"].bool()[:, None, :, None] & x["attention_mask"].bool()[:, None, None, :]
    for l in range(a.n_layers):
        got, ref = cache[a.site_name(l, "pattern")], eager.attentions[l]
        torch.testing.assert_close(got * real, ref * real, atol=1e-5, rtol=1e-5)
    # a backend inside the wrapped model; gates act on the LoRA branch of W^O too
    with torch.no_grad(), a.use_backend("tiled"):
        torch.testing.assert_close(_main(pm(**x)), _main(eager), atol=1e-4, rtol=1e-4)
    a.gates[1, 1] = 0.0
    m.gates[1, 1] = 0.0
    with torch.no_grad():
        torch.testing.assert_close(_main(pm(**x)), _main(merged(**x)), atol=1e-5, rtol=1e-5)
    a.reset_gates()
    m.reset_gates()
    # the load-time check ran at adapt: seven checks (lora first), all passed; the model's tensors put back after
    v = a.verdict
    assert [c.name for c in v.checks] == ["lora", "pattern", "output", "values", "heads", "gate", "residual"]
    assert v.passed and not v.cached, v.failed
    torch.testing.assert_close(_weights(a)[("W_O", 1)], want[("W_O", 1)], atol=1e-6, rtol=1e-6)
    own = dict(pm.get_base_model().named_parameters())
    for n, p in base.named_parameters():
        wrapped = n.rpartition(".")[0] + ".base_layer." + n.rpartition(".")[2]
        assert torch.equal(own[n] if n in own else own[wrapped], p), n
        assert not getattr(pm.get_base_model().get_submodule(n.rpartition(".")[0]), "merged", False), n


def test_peft_merge_and_weight_analyses_agree():
    """PEFT's own merge_and_unload gives the same per-head weights; the OV copying score and the norms read them."""
    from headlab.interpret.atlas.scores import ov_copying

    base, pm = _lora("gpt2")
    merged = copy.deepcopy(pm).merge_and_unload()
    a, m = adapt(pm), adapt(merged)
    for key, w in _weights(m).items():
        torch.testing.assert_close(_weights(a)[key], w, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ov_copying(a), ov_copying(m), atol=1e-6, rtol=1e-6)
    x = {"input_ids": inputs("gpt2")["input_ids"][:1]}
    na, nm = headlab.attention_norms(pm, x), headlab.attention_norms(merged, x)
    for l in na.per_head:
        torch.testing.assert_close(na.per_head[l], nm.per_head[l], atol=1e-5, rtol=1e-5)


def test_zero_b_is_the_base_model():
    base, pm = _lora("llama", zero_b=True)
    a, b = adapt(pm), adapt(base)
    for key, w in _weights(b).items():
        assert torch.equal(_weights(a)[key], w), key
    x = inputs("llama")
    with torch.no_grad():
        torch.testing.assert_close(_main(pm(**x)), _main(base(**x)), atol=0.0, rtol=0.0)
    ex = [x["input_ids"][0], x["input_ids"][1]]
    torch.testing.assert_close(headlab.head_importance(pm, ex), headlab.head_importance(base, ex), atol=1e-6, rtol=1e-5)
    # unmerged, the per-head weights are functions of A and B: a gradient reaches the adapter
    a.W_V(0).sum().backward()
    grad = pm.get_base_model().model.layers[0].self_attn.v_proj.lora_B["default"].weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_unmerged_and_merged_give_the_same_importance():
    base, pm = _lora("qwen3_moe")
    merged = _merged_by_hand(base, pm)
    x = inputs("qwen3_moe")
    ex = [x["input_ids"][0], x["input_ids"][1]]
    got, want = headlab.head_importance(pm, ex), headlab.head_importance(merged, ex)
    assert (want > 0).any()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    # in PEFT's in-place merged state (merge_adapter) the weights are views of the model's again
    pm.merge_adapter()
    a = adapt(pm)
    wo = pm.get_base_model().model.layers[0].self_attn.o_proj.base_layer.weight
    assert a.W_O(0).untyped_storage().data_ptr() == wo.untyped_storage().data_ptr()
    torch.testing.assert_close(headlab.head_importance(pm, ex), want, atol=1e-6, rtol=1e-4)


def test_pruning_refuses_until_merged():
    base, pm = _lora("llama")
    with pytest.raises(PruneError, match="merge_and_unload"):
        headlab.prune_heads(pm, {0: [1]})
    merged = copy.deepcopy(pm).merge_and_unload()
    p = headlab.prune_heads(merged, {0: [1]})
    a = adapt(pm)
    a.gates[0, 1] = 0.0
    x = inputs("llama")
    with torch.no_grad():
        torch.testing.assert_close(_main(p.model(**x)), _main(pm(**x)), atol=1e-4, rtol=1e-4)
    a.reset_gates()


def test_stale_adapters_are_replaced():
    """An adapter built before LoRA wrapped the model (its gate hooks sat on the base layers) and one built
    before merge_and_unload are closed and rebuilt: the gates act on what the model computes."""
    model = build("llama")
    plain = copy.deepcopy(model)
    old = adapt(model)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["o_proj"],
                                                    init_lora_weights=False)).eval()
    a = adapt(pm)
    assert a is not old and getattr(a, "lora", False) and not old._handles
    x = inputs("llama")
    merged = _merged_by_hand(plain, pm)
    a.gates[0, 2] = 0.0
    adapt(merged).gates[0, 2] = 0.0
    with torch.no_grad():
        torch.testing.assert_close(_main(pm(**x)), _main(merged(**x)), atol=1e-5, rtol=1e-5)
    a.reset_gates()
    unloaded = pm.merge_and_unload()
    b = adapt(unloaded)
    assert not getattr(b, "lora", False) and b is not a
    torch.testing.assert_close(b.W_O(0), adapt(merged).W_O(0), atol=1e-6, rtol=1e-6)


def test_load_adapter_folder_and_merged_folder(tmp_path):
    base, pm = _lora("gpt2")
    base.save_pretrained(tmp_path / "base")
    pm.peft_config["default"].base_model_name_or_path = str(tmp_path / "base")
    pm.save_pretrained(tmp_path / "lora")
    copy.deepcopy(pm).merge_and_unload().save_pretrained(tmp_path / "merged")
    lora, merged = headlab.load(tmp_path / "lora"), headlab.load(tmp_path / "merged")
    assert lora.adapter.lora and lora.family == "gpt2" and lora.adapter.peft is not None
    assert not getattr(merged.adapter, "lora", False)
    for key, w in _weights(merged.adapter).items():
        torch.testing.assert_close(_weights(lora.adapter)[key], w, atol=1e-6, rtol=1e-6)
    x = inputs("gpt2")
    with torch.no_grad():
        torch.testing.assert_close(_main(lora.model(**x)), _main(pm(**x)), atol=1e-5, rtol=1e-5)
    cache = headlab.capture(lora, {"input_ids": x["input_ids"][:1]}, ["blocks.1.attn.pattern"])
    with torch.no_grad():
        ref = merged.model(input_ids=x["input_ids"][:1], output_attentions=True).attentions[1]
    torch.testing.assert_close(cache["blocks.1.attn.pattern"], ref, atol=1e-5, rtol=1e-5)
    # headlab models --check prints the seven checks of the LoRA model
    from typer.testing import CliRunner

    from headlab.cli.main import app

    res = CliRunner().invoke(app, ["models", "--check", str(tmp_path / "lora")])
    assert res.exit_code == 0, res.output
    assert "pass  lora" in res.output and "pass  gate" in res.output and "served" in res.output
    # a base model that is not there: said, nothing downloaded
    cfg = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "someone/not-here"
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="nothing is downloaded"):
        headlab.load(tmp_path / "lora")


def test_refused_with_what_to_do():
    _, dora = _lora("llama", use_dora=True)
    with pytest.raises(UnsupportedArchitectureError, match="LoRA variant.*merge_and_unload"):
        adapt(dora)
    model = build("gpt2")
    head = peft.get_peft_model(model, peft.LoraConfig(r=R, target_modules=["c_attn", "lm_head"]))
    with pytest.raises(UnsupportedArchitectureError, match="LM head.*merge_and_unload"):
        adapt(head)
    prompt = peft.get_peft_model(build("llama"), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(UnsupportedArchitectureError, match="PROMPT_TUNING, not LoRA"):
        adapt(prompt)
