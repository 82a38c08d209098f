"""Adapting by structure and the load-time check (headlab.models.hf.structure, headlab.models.hf.verify).

- the layouts structure finds equal what the declared families say, on the declared architectures;
- types whose structure headlab cannot serve are refused, on adapt and on load, with what was found;
- a view that is wrong (a swapped projection, a wrong norm layout, a broken W^O) fails the named check, and a
  model that fails is never served: the refusal names the check, the difference and the nearest family;
- verdicts are cached per config; ``headlab models --check`` prints every check; inputs are built per kind.
"""

from __future__ import annotations

import json

import pytest
import torch

import headlab
from headlab.errors import HeadlabError, InputError, UnsupportedArchitectureError
from headlab.models import adapt
from headlab.models.hf import FAMILIES, adapter_class
from headlab.models.hf.structure import adapter_class_for, discover
from headlab.models.hf.support import STRUCTURE_LIMITS
from headlab.models.hf.verdict import Verdict
from headlab.models.hf.verify import verify
from headlab.models.inputs import complete_inputs, example_inputs, input_kind
from headlab.models.projections import Separate

import architectures as A
from conftest import refusal_check, run_cli

# declared families whose layout structure can read (the rest: shared blocks, own attention, ALiBi, T5's layer list)
COMPARABLE = ["bert", "roberta", "distilbert", "electra", "gpt2", "gpt_neox", "gptj", "opt", "llama", "mistral",
              "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "stablelm", "starcoder2", "cohere",
              "vit", "bart", "whisper", "modernbert", "olmo2"]


@pytest.mark.parametrize("name", COMPARABLE)
def test_structure_finds_what_the_family_declares(name):
    """On declared architectures, discovery (which never reads the declaration) finds the same projections, W^O
    and norm layout, and the same head counts."""
    model = A.build(name)
    found = discover(model)
    fam = adapter_class(model.config.model_type)
    a = adapt(model)
    assert found.shape == (a.n_heads, a.n_kv_heads, a.head_dim, a.d_model)
    lay = found.layouts.get("blocks", found.layouts.get("encoder"))
    assert lay.projections == fam.projections
    assert lay.out.path == fam.out.path and lay.out.conv1d == fam.out.conv1d
    declared = a.attention_norm(0)
    assert lay.norms is not None, lay.norms_why
    got = lay.norms.resolve(a.blocks[0])
    assert got.layout == declared.layout
    assert got.pre is declared.pre or (declared.pre is not None and got.pre is None and name == "modernbert")
    assert got.post is declared.post and got.parallel is declared.parallel
    if declared.post is not None:
        assert (got.kind, got.offset) == (declared.kind, declared.offset)
    assert found.is_decoder == a.is_decoder


@pytest.mark.parametrize("name", sorted(A.REFUSED_BY_STRUCTURE))
def test_unservable_structures_are_refused_with_what_was_found(name, tmp_path, sweep):
    model = A.build(name)
    why = A.REFUSED_BY_STRUCTURE[name][1]
    with pytest.raises(UnsupportedArchitectureError, match=why) as e:
        adapt(model)
    sweep(name, "refused", refusal_check(str(e.value)))
    model.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match=f"'{model.config.model_type}'"):
        headlab.load(tmp_path)


def test_every_structure_type_is_undeclared_and_verified():
    """The suite's structure types are named by no family (so they really run the discovery path), and each
    passes every load-time check."""
    declared = {t for fam in FAMILIES for t in fam.model_types}
    for name in A.STRUCTURE:
        model = A.build(name)
        assert model.config.model_type not in declared, name
        a = adapt(model)  # adapt ran the check (a failure would have raised); its verdict is cached per config
        assert getattr(a, "by_structure", False)
        v = verify(a)
        assert v.passed, (name, v.failed)
        assert [c.name for c in v.checks] == ["pattern", "output", "values", "heads", "gate", "residual"]
        # the support table's caveats are the ones the found view carries
        assert ("norms" in type(a).limits) == ("residual-mode norms refused" in STRUCTURE_LIMITS.get(name, "")), name


@pytest.mark.parametrize("name", [n for n in A.DECLARED if n not in ("deberta-v2",)])
def test_every_declared_view_passes_the_check(name):
    """The check never refuses a view the suite proves right: every declared family passes it (ALBERT's shared
    block, Falcon's in-place MLP add, T5's relative bias, encoder-decoders included)."""
    v = verify(adapt(A.build(name)), cache=False)
    assert v.passed, v.failed


def _fresh(name):
    model = A.build(name)
    cls, found = adapter_class_for(model)
    return model, cls, found


def test_a_swapped_projection_fails_the_values_check():
    """Declaring W_Q where W_V is makes x W_V differ from the values the attention reads: the check fails, names
    itself and the amount; adapt refuses the model."""
    model, cls, found = _fresh("camembert")  # multi-head: W_K and W_V have the same shape
    bad = type("Bad", (cls,), {"projections": Separate("query", "key", "key")})
    a = bad(model)
    try:
        v = verify(a, cache=False)
    finally:
        a.close()
    assert not v.passed and v.failed.name == "values" and v.failed.worst > 1e-2
    msg = v.refusal()
    assert "'values'" in msg and "worst difference" in msg and "nearest" in msg and "adding-a-family" in msg


def test_a_wrong_norm_layout_fails_the_residual_check():
    from headlab.models.hf.family import Norms

    model, cls, _ = _fresh("camembert")  # post-LN, like BERT
    bad = type("Bad", (cls,), {"norms": Norms(pre="attention.output.LayerNorm", kind="layernorm")})
    a = bad(model)
    try:
        v = verify(a, cache=False)
    finally:
        a.close()
    assert not v.passed and v.failed.name == "residual"


def test_a_wrong_output_projection_fails_and_the_model_is_not_served(monkeypatch):
    """A W^O read as the wrong module: the gate no longer acts on the attention output; adapt refuses with the
    check's name instead of serving numbers."""
    from headlab.models.hf import structure
    from headlab.models.projections import Out

    model, cls, found = _fresh("smollm3")
    lay = found.layouts["blocks"]
    broken = structure.Layout(attention=lay.attention, projections=lay.projections, out=Out("mlp.down_proj"),
                              norms=lay.norms)
    monkeypatch.setitem(found.layouts, "blocks", broken)
    with pytest.raises((UnsupportedArchitectureError, HeadlabError)):
        structure.adapt_by_structure(model)


def test_the_verdict_is_cached_per_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path))
    from headlab.models.hf import verify as V

    monkeypatch.setattr(V, "_VERDICTS", {})
    model = A.build("glm4")
    a = adapt(model)
    first = verify(a)
    assert first.passed and not first.cached and list(tmp_path.glob("verdicts/*.json"))
    V._VERDICTS.clear()  # a new process: read from the cache folder
    again = verify(a)
    assert again.passed and again.cached and [c.name for c in again.checks] == [c.name for c in first.checks]


def test_a_type_no_test_names_loads_from_a_folder(tmp_path):
    """Load (not adapt) of a type named nowhere else in the suite (GLM-4 MoE): checked at load, served, and its
    patterns equal eager; BitNet (a norm between the attention output and W^O) is refused with what was seen."""
    assert "glm4_moe" not in A.NAMES and "bitnet" not in A.NAMES
    torch.manual_seed(0)
    model = A._auto("glm4_moe", pad_token_id=0, eos_token_id=2, bos_token_id=1, first_k_dense_replace=1,
                    n_routed_experts=2, n_shared_experts=1)().eval()
    model.save_pretrained(tmp_path)
    lm = headlab.load(tmp_path)
    assert lm.adapter.family == "glm4_moe" and getattr(lm.adapter, "by_structure", False)
    x = A.inputs("llama", padded=False)
    cache = headlab.capture(lm, x, ["blocks.*.attn.pattern"])
    with torch.no_grad():
        eager = lm.model(**x, output_attentions=True).attentions
    for l in range(lm.adapter.n_layers):
        torch.testing.assert_close(cache[f"blocks.{l}.attn.pattern"], eager[l], atol=1e-5, rtol=1e-5)
    with pytest.raises(UnsupportedArchitectureError, match="'bitnet'.*reads the attention output"):
        adapt(A._auto("bitnet", pad_token_id=0, eos_token_id=2, bos_token_id=1)().eval())


def test_models_check_prints_every_check(tmp_path, capsys):
    model = A.build("camembert")
    model.save_pretrained(tmp_path)
    code, out, err = run_cli(["models", "--check", tmp_path], capsys)
    assert code == 0, out + err
    for name in ("pattern", "output", "values", "heads", "gate", "residual"):
        assert f"pass  {name}" in out
    assert "adapted by structure" in out and "served" in out and "z_h W_O[h]" in out
    code, out, _ = run_cli(["models"], capsys)  # the table names the types the suite verifies by structure
    assert code == 0 and "qwen3_moe" in out and "adapted by its structure" in out
    code, out, _ = run_cli(["models", "--check", tmp_path, "--json"], capsys)
    assert code == 0 and json.loads(out)["verdict"]["model_type"] == "camembert"


def test_models_check_of_a_failing_view_exits_1(tmp_path, capsys, monkeypatch):
    """A model whose view fails a check: every check printed, FAIL on the failing one, exit 1."""
    from headlab.models.hf import structure
    from headlab.models.projections import Separate as S

    model = A.build("camembert")
    model.save_pretrained(tmp_path)
    real = structure.adapter_class_for

    def swapped(m):
        cls, found = real(m)
        return type("Bad", (cls,), {"projections": S("query", "key", "key")}), found
    monkeypatch.setattr(structure, "adapter_class_for", swapped)
    code, out, _ = run_cli(["models", "--check", tmp_path], capsys)
    assert code == 1 and "FAIL  values" in out and "refused" in out


def test_models_check_on_a_refused_type_exits_2(tmp_path, capsys):
    A.build("deepseek_v3").save_pretrained(tmp_path)  # a type the registry refuses (MPT was, until it was served)
    capsys.readouterr()  # the save's progress bar
    code, out, err = run_cli(["models", "--check", tmp_path], capsys)
    assert code == 2 and "'deepseek_v3'" in err and len(err.strip().splitlines()) == 1


def test_the_inputs_each_model_takes():
    vit = A.build("deit")
    assert input_kind(vit) == "pixel_values" and example_inputs(vit)["pixel_values"].shape == (1, 3, 16, 16)
    wav = A.build("wav2vec2")
    assert input_kind(wav) == "input_values"
    with torch.no_grad():
        wav(**example_inputs(wav))  # the front end turns it into frames
    with pytest.raises(InputError, match="takes 'pixel_values'"):
        complete_inputs(vit, {"input_ids": torch.ones(1, 3, dtype=torch.long)})
    t5 = A.build("mt5")
    ids = torch.tensor([[5, 6, 7]])
    done = complete_inputs(t5, {"input_ids": ids})
    assert done["decoder_input_ids"].tolist() == [[t5.config.decoder_start_token_id, 5, 6]]


def test_importance_of_an_encoder_decoder_from_token_ids_alone():
    """Token ids without decoder inputs: the decoder is teacher-forced on the input shifted right."""
    model = A.build("mbart")
    imp = headlab.head_importance(model, [torch.tensor([5, 6, 7, 8])], batch_size=1)
    a = adapt(model)
    assert imp.shape == (a.n_layers, a.n_heads) and torch.isfinite(imp).all() and (imp > 0).any()


def test_verdict_round_trips_json():
    model = A.build("glm4")
    v = verify(adapt(model), cache=False)
    back = Verdict(**{**v.to_json(), "checks": []})
    assert back.model_type == v.model_type and v.seconds > 0


@pytest.mark.parametrize("name", ["deit", "wav2vec2", "mbart"])
def test_ablation_and_flow_take_the_inputs_each_model_takes(name):
    """Ablation and attention flow on an image encoder, an audio encoder and an encoder-decoder (dict batches):
    the ablation of a head is the loss change that gating it by hand gives; flow is a distribution over inputs."""
    model = A.build(name)
    a = adapt(model)
    x = A.inputs(name, padded=False)
    ex = [{k: v[i:i + 1] for k, v in x.items()} for i in range(2)]
    r = headlab.ablate(model, ex, heads=[(0, 1), (1, 2)], k=2, keep_one=False, n_boot=20, cka=False)
    assert torch.isfinite(r.single[0, 1]) and float(r.single[0, 1]) != 0.0
    f = headlab.attention_flow(model, ex[0], stack=None if len(a.stacks) == 1 else "encoder")
    assert torch.isfinite(f.flow).all() and float(f.flow.sum()) == pytest.approx(1.0, abs=1e-6)


def test_patching_an_image_classifier_equals_a_hand_made_patch():
    """Exact patching with pixel inputs: the effect of head 0's z in the last layer is the metric change that
    replacing it by hand (with the corrupted run's z) gives, normalised by the clean-corrupted gap (a small gap
    here: the normalised effect is large, so it is compared to 1e-3)."""
    import transformers as T

    torch.manual_seed(0)
    vit = T.ViTForImageClassification(T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                  intermediate_size=64, image_size=16, patch_size=4, num_labels=3,
                                                  attn_implementation="eager")).eval()
    x = A.inputs("vit")
    clean, corrupt = ({"pixel_values": x["pixel_values"][i:i + 1]} for i in range(2))

    def metric(logits):
        return logits[:, 0] - logits[:, 1]
    r = headlab.patch(vit, clean, corrupt, metric)
    a = adapt(vit)
    site = a.site_name(1, "z")
    zc = headlab.capture(vit, corrupt, [site])[site]
    with torch.no_grad():
        m_clean = float(metric(vit(**clean).logits))
        m_corr = float(metric(vit(**corrupt).logits))

        def put(z, s):
            z = z.clone()
            z[:, 0] = zc[:, 0]
            return z
        with a.hooks({site: put}):
            m_patched = float(metric(vit(**clean).logits))
    assert float(r.raw["z"][1, 0]) == pytest.approx(m_patched - m_clean, rel=1e-4, abs=1e-5)
    assert float(r.effects["z"][1, 0]) == pytest.approx((m_patched - m_clean) / (m_corr - m_clean), rel=1e-3)
