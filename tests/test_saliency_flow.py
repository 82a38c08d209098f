"""headlab.explain's flow methods (rollout, norm_rollout, attention_flow, attention_norm) against independent
computations of their definitions, on tiny random models built inline (a BERT classifier and a Llama decoder
with grouped KV heads, float64, the bundled MiniLM tokenizer): numpy products of Hugging Face's own eager
attention maps, value vectors from the models' own projection weights, and networkx's Edmonds-Karp for the flow.
They enter the study's faithfulness table and agreement like the other methods; the CLI takes them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

import headlab
from headlab.attention import backends as hb
from headlab.errors import ConfigError
from headlab.interpret.saliency import DEFAULT_METHODS, METHODS, explain
from headlab.models import adapt
from headlab.models.loader import LoadedModel

TEXT = "a gripping , funny and moving film"
FLOW = ("rollout", "norm_rollout", "attention_flow", "attention_norm")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tokenizer():
    from headlab.models.named_models import minilm_dir

    return transformers.AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)


def _wrap(model, tokenizer, name):
    model = model.double().eval()
    with torch.no_grad():  # value norms that differ from token to token and head to head
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    adapter = adapt(model)
    return LoadedModel(model, tokenizer, adapter, name, adapter.family, 64)


@pytest.fixture(scope="module")
def clf(tokenizer):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                  attn_implementation="eager", num_labels=3)
    return _wrap(transformers.BertForSequenceClassification(cfg), tokenizer, "tiny-bert-clf")


@pytest.fixture(scope="module")
def llama(tokenizer):
    torch.manual_seed(2)
    cfg = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, attn_implementation="eager")
    return _wrap(transformers.LlamaForCausalLM(cfg), tokenizer, "tiny-llama")


# -- the definitions, computed independently ------------------------------------------------------------------
def _value_vectors(loaded, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """f_h(x_j) = (x_j W_V + b_V) W_O^h from the model's own modules: (H, n, E). x is the attention's input."""
    m = loaded.model
    if loaded.family == "bert":
        blk = m.bert.encoder.layer[layer].attention
        x, vproj, wo, H = hidden, blk.self.value, blk.output.dense.weight, m.config.num_attention_heads
        Hkv = H
    else:
        blk = m.model.layers[layer]
        x, vproj, wo = blk.input_layernorm(hidden), blk.self_attn.v_proj, blk.self_attn.o_proj.weight
        H, Hkv = m.config.num_attention_heads, m.config.num_key_value_heads
    d = wo.shape[1] // H
    v = vproj(x).view(x.shape[0], Hkv, d).repeat_interleave(H // Hkv, dim=1)  # (n, H, d)
    return torch.stack([v[:, h] @ wo[:, h * d:(h + 1) * d].T for h in range(H)])  # (H, n, E)


def _reference(loaded, text=TEXT):
    """Per layer: the eager maps (H, n, n) and the layer norm maps ||sum_h a_h[i, j] f_h(x_j)|| (n, n), as numpy."""
    enc = loaded.encode(text)
    with torch.no_grad():
        out = loaded.model(**enc, output_attentions=True, output_hidden_states=True)
        maps = [a[0] for a in out.attentions]
        norms = []
        for l, A in enumerate(maps):
            f = _value_vectors(loaded, l, out.hidden_states[l][0])  # (H, n, E)
            norms.append(torch.einsum("hij,hje->ije", A, f).norm(dim=-1))  # (n, n)
    n = enc["input_ids"].shape[1]
    c = n - 1 if loaded.adapter.causal else 0
    return [a.numpy() for a in maps], [x.numpy() for x in norms], c


def _augment(A: np.ndarray) -> np.ndarray:
    a = 0.5 * A + 0.5 * np.eye(A.shape[-1])
    return a / a.sum(-1, keepdims=True)


def _rollout(mats) -> np.ndarray:
    R = np.eye(mats[0].shape[0])
    for A in mats:
        R = _augment(A) @ R
    return R


def _networkx_flow(mats, source: int) -> np.ndarray:
    nx = pytest.importorskip("networkx", reason="networkx is the paper's max-flow reference")
    n, L = mats[0].shape[0], len(mats)
    G = nx.DiGraph()
    for t, A in enumerate(mats, start=1):
        Ah = _augment(A)
        for i in range(n):
            for j in range(n):
                if Ah[i, j] > 0:
                    G.add_edge((t, i), (t - 1, j), capacity=float(Ah[i, j]))
    vals = np.array([nx.maximum_flow_value(G, (L, source), (0, j), flow_func=nx.algorithms.flow.edmonds_karp)
                     for j in range(n)])
    return vals / vals.sum()


# -- each score equals its definition ----------------------------------------------------------------------------
@pytest.mark.parametrize("model_name", ["clf", "llama"])
def test_flow_methods_equal_their_definitions(model_name, request):
    loaded = request.getfixturevalue(model_name)
    maps, norms, c = _reference(loaded)
    ex = explain(loaded, TEXT, methods=FLOW, backend="sdpa")
    assert ex.methods == list(FLOW) and ex.position == c
    mean = [A.mean(0) for A in maps]
    np.testing.assert_allclose(ex.scores["rollout"], _rollout(mean)[c], rtol=1e-6, atol=1e-9)
    row_normed = [N / N.sum(-1, keepdims=True) for N in norms]
    np.testing.assert_allclose(ex.scores["norm_rollout"], _rollout(row_normed)[c], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(ex.scores["attention_norm"], norms[-1][c], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(ex.scores["attention_flow"], _networkx_flow(mean, c), rtol=0, atol=1e-6)
    # and the rollout row is the classification position's row of headlab.rollout's full maps
    full = headlab.rollout(loaded, TEXT).maps[-1][c]
    np.testing.assert_allclose(ex.scores["rollout"], full.numpy(), atol=1e-6)
    if loaded.adapter.causal:  # a decoder's last position sees every token; the first token's flow is its own
        assert all(v >= 0 for v in ex.scores["attention_flow"])
    assert len(ex.agreement(methods=FLOW).pairs) == 6


def test_defaults_leave_flow_out_and_approximate_backends_run_exact(clf):
    assert set(METHODS) - set(DEFAULT_METHODS) == {"attention_flow"}
    assert {"rollout", "norm_rollout", "attention_norm"} <= set(DEFAULT_METHODS)
    ex = explain(clf, TEXT, ig_steps=4)
    assert ex.methods == list(DEFAULT_METHODS)
    assert not hb.get("linear").capabilities.exact  # the built-in approximate backend
    exact = explain(clf, TEXT, methods=("rollout",), backend="sdpa")
    approx = explain(clf, TEXT, methods=("rollout", "attention_norm"), backend="linear")
    np.testing.assert_allclose(approx.scores["rollout"], exact.scores["rollout"], atol=1e-9)
    assert any("exact softmax" in n and "'linear'" in n for n in approx.notes)


def test_unknown_method_names_the_closest(clf):
    with pytest.raises(ConfigError, match=r"'rolout'.*did you mean 'rollout'.*attention_flow, attention_norm"):
        explain(clf, TEXT, methods=("rolout",))
    with pytest.raises(ConfigError, match="did you mean 'attention_flow'"):
        explain(clf, TEXT, methods="gradient,attention-flow")


# -- the study: faithfulness and agreement ------------------------------------------------------------------------
def test_study_tables_carry_the_flow_methods(clf, tmp_path):
    from headlab.interpret.saliency import StudyOptions, study

    data = tmp_path / "d.tsv"
    data.write_text("sentence\tlabel\na gripping film\t1\na dull , tired film\t0\n", encoding="utf-8")
    methods = ("attention", "gradient", *FLOW)
    opts = StudyOptions(methods=methods, counterfactual=False, bootstrap=20)
    r = study(clf, data, tmp_path / "out", options=opts, progress=False, figures=False)
    assert r.instances == 2
    assert set(r.tables["faithfulness"]) == {*methods, "random"}
    assert set(r.tables["kendall"]) == {"gradient", *FLOW}
    assert "rollout|attention_flow" in r.tables["pairs"]
    recs = list(json.loads((tmp_path / "out" / "instances.json").read_text())["units"].values())
    for rec, text in zip(recs, ("a gripping film", "a dull , tired film")):
        ex = explain(clf, text, methods=FLOW)
        for m in FLOW:
            np.testing.assert_allclose(rec["scores"][m], ex.scores[m], atol=1e-9)
    for m in FLOW:
        got = r.tables["faithfulness"][m]["aopc_comprehensiveness"]["mean"]
        assert got == pytest.approx(np.mean([x["eraser"][m]["aopc_comprehensiveness"] for x in recs]))
        tau = r.tables["kendall"][m]["mean"]
        assert tau == pytest.approx(np.nanmean([np.nan if x["tau"][f"attention|{m}"][0] is None
                                                else x["tau"][f"attention|{m}"][0] for x in recs]))


# -- the command line -------------------------------------------------------------------------------------------
def test_cli_takes_the_flow_methods(clf, tmp_path, capsys):
    from conftest import run_cli

    d = tmp_path / "clf"
    clf.model.float().save_pretrained(d)
    clf.model.double()
    clf.tokenizer.save_pretrained(d)
    code, out, err = run_cli(["explain", TEXT, "--model", d, "--methods", ",".join(FLOW), "--json"], capsys)
    assert code == 0, err
    j = json.loads(out)
    assert list(j["scores"]) == list(FLOW)
    ex = explain(clf, TEXT, methods=FLOW)
    for m in FLOW:
        np.testing.assert_allclose(j["scores"][m], ex.scores[m], atol=1e-5)  # the saved model is float32
    code, out, _ = run_cli(["explain", TEXT, "--model", d, "--methods", "rollout,attention_flow,attention_norm"],
                           capsys)
    assert code == 0 and "rollout" in out and "flow" in out and "Kendall" in out
    code, _, err = run_cli(["explain", TEXT, "--model", d, "--methods", "gradient,rolout"], capsys)
    assert code == 2 and "did you mean 'rollout'" in err and len(err.strip().splitlines()) <= 3
    code, out, _ = run_cli(["explain", "--help"], capsys)
    assert code == 0 and "attention_flow" in out
