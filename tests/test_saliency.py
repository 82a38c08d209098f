"""headlab.explain against independent computations of each published definition.

Tiny random models built inline (a BertForSequenceClassification, a bare BertModel, a Llama decoder),
all with the bundled MiniLM tokenizer, in float64 so finite differences are sharp.
"""

from __future__ import annotations

import re

import itertools
import math

import numpy as np
import pytest
import scipy.stats as scipy_stats
import torch
import transformers

from headlab.attention import backends as hb
from headlab.errors import ConfigError, InputError, ModelError, UnknownBackendError
from headlab.interpret.saliency import explain
from headlab.interpret.saliency.attention import edited_pattern, replace_row
from headlab.interpret.saliency.objective import make_objective
from headlab.models import adapt
from headlab.models.loader import LoadedModel

TEXT = "a gripping , funny and moving film"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one torch thread is faster, and far faster on a loaded machine (no spin-waiting)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tokenizer():
    from headlab.models.named_models import minilm_dir as _minilm_dir

    return transformers.AutoTokenizer.from_pretrained(_minilm_dir(), local_files_only=True)


def _wrap(model, tokenizer, name, max_positions=64):
    model = model.double().eval()
    adapter = adapt(model)
    return LoadedModel(model, tokenizer, adapter, name, adapter.family, max_positions)


def _bert_cfg(tokenizer, **kw):
    return dict(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=64, attn_implementation="eager", **kw)


@pytest.fixture(scope="module")
def clf(tokenizer):
    torch.manual_seed(0)
    m = transformers.BertForSequenceClassification(transformers.BertConfig(**_bert_cfg(tokenizer, num_labels=3)))
    return _wrap(m, tokenizer, "tiny-bert-clf")


@pytest.fixture(scope="module")
def encoder(tokenizer):
    torch.manual_seed(1)
    return _wrap(transformers.BertModel(transformers.BertConfig(**_bert_cfg(tokenizer))), tokenizer, "tiny-bert")


@pytest.fixture(scope="module")
def llama(tokenizer):
    torch.manual_seed(2)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager"))
    return _wrap(m, tokenizer, "tiny-llama")


def _enc(loaded, text=TEXT):
    return loaded.encode(text)


def _y_from_embeds(loaded, embeds, mask, target, causal=False):
    """y straight from Hugging Face's own ``inputs_embeds`` path (independent of headlab's hook)."""
    out = loaded.model(inputs_embeds=embeds, attention_mask=mask)
    if causal:
        return out.logits[:, int(mask[0].sum()) - 1, target]
    return out.logits[:, target]


def _fd_grad(loaded, target, causal=False, h=1e-5):
    """dy/de by central finite differences, every coordinate, batched."""
    enc = _enc(loaded)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    e = loaded.model.get_input_embeddings()(ids).detach()  # (1, L, E)
    L, E = e.shape[1:]
    eye = torch.eye(L * E, dtype=e.dtype).view(L * E, L, E)
    with torch.no_grad():
        plus = _y_from_embeds(loaded, e + h * eye, mask.expand(L * E, L), target, causal)
        minus = _y_from_embeds(loaded, e - h * eye, mask.expand(L * E, L), target, causal)
    return ((plus - minus) / (2 * h)).view(L, E), e[0]


@pytest.mark.parametrize("model_name", ["clf", "llama"])
def test_gradients_equal_finite_differences(model_name, request):
    loaded = request.getfixturevalue(model_name)
    ex = explain(loaded, TEXT, methods=("gradient", "grad_x_input"), backend="sdpa")
    # Llama's RMSNorm computes in float32 even in a float64 model: a wider step, a looser tolerance
    llama = model_name == "llama"
    g, e = _fd_grad(loaded, ex.target, causal=llama, h=1e-3 if llama else 1e-5)
    rtol, atol = (2e-3, 1e-5) if llama else (1e-6, 1e-9)
    np.testing.assert_allclose(ex.scores["gradient"], g.norm(dim=-1).numpy(), rtol=rtol, atol=atol)
    np.testing.assert_allclose(ex.scores["grad_x_input"], (g * e).sum(-1).numpy(), rtol=rtol, atol=atol)


def test_target_is_the_prediction_and_its_logit(clf, llama):
    enc = _enc(clf)
    logits = clf.model(**enc).logits[0].detach()
    ex = explain(clf, TEXT, methods=("gradient",))
    assert ex.target == int(logits.argmax()) and ex.y == pytest.approx(float(logits.max()))
    assert ex.probs == pytest.approx(torch.softmax(logits, -1).tolist())
    ex2 = explain(clf, TEXT, target=2, methods=("gradient",))
    assert ex2.target == 2 and ex2.y == pytest.approx(float(logits[2]))
    enc = _enc(llama)
    last = llama.model(**enc).logits[0, -1]
    exl = explain(llama, TEXT, methods=("gradient",))
    assert exl.kind == "next_token" and exl.target == int(last.argmax()) and exl.position == enc["input_ids"].shape[1] - 1


def test_integrated_gradients_completeness_and_a_direct_riemann_sum(clf):
    ex = explain(clf, TEXT, methods=("integrated_gradients",))
    enc = _enc(clf)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    emb = clf.model.get_input_embeddings()
    e = emb(ids).detach()
    special = torch.tensor([t in clf.tokenizer.all_special_ids for t in ids[0].tolist()])
    b = e.clone()
    b[0, ~special] = emb.weight[clf.tokenizer.pad_token_id].detach()
    with torch.no_grad():
        y_x, y_b = (float(_y_from_embeds(clf, t, mask, ex.target)) for t in (e, b))
    # the completeness axiom: sum_t IG_t = y(x) - y(baseline)
    assert sum(ex.scores["integrated_gradients"]) == pytest.approx(y_x - y_b, rel=1e-3)
    assert ex.completeness_gap < 1e-3 and ex.y_baseline == pytest.approx(y_b)
    assert all(ex.scores["integrated_gradients"][i] == 0 for i in range(len(ids[0])) if special[i])
    # a direct midpoint Riemann sum with many steps (one batch), from Hugging Face's own inputs_embeds path
    m = 300
    a = ((torch.arange(m, dtype=e.dtype) + 0.5) / m).view(m, 1, 1)
    x = (b + a * (e - b)).requires_grad_(True)  # (m, L, E)
    (g,) = torch.autograd.grad(_y_from_embeds(clf, x, mask.expand(m, -1), ex.target).sum(), [x])
    direct = ((e - b)[0] * g.mean(0)).sum(-1)
    np.testing.assert_allclose(ex.scores["integrated_gradients"], direct.numpy(), rtol=1e-3, atol=1e-6)


def test_ig_riemann_equals_the_same_riemann_loop(clf):
    from headlab.interpret.saliency.integrated import default_baseline, integrated_gradients
    from headlab.interpret.saliency.objective import baseline_id, special_mask

    enc = _enc(clf)
    obj, _ = make_objective(clf, enc, None, None)
    special = special_mask(clf, enc["input_ids"])
    base = default_baseline(obj, enc["input_ids"], special, baseline_id(clf))
    one = integrated_gradients(obj, enc["input_ids"], enc["attention_mask"], base, steps=7, method="riemann_middle",
                               batch_size=1)
    many = integrated_gradients(obj, enc["input_ids"], enc["attention_mask"], base, steps=7, method="riemann_middle",
                                batch_size=7)
    torch.testing.assert_close(one.scores, many.scores)


@pytest.mark.parametrize("mode", ["delete", "mask", "unk"])
def test_leave_one_out_by_direct_removal(clf, mode):
    ex = explain(clf, TEXT, methods=("leave_one_out",), loo=mode)
    tok = clf.tokenizer
    ids = _enc(clf)["input_ids"][0].tolist()
    with torch.no_grad():
        p0 = torch.softmax(clf.model(input_ids=torch.tensor([ids])).logits[0], -1)
    for t, s in enumerate(ex.special):
        if s:
            assert ex.scores["leave_one_out"][t] == 0
            continue
        if mode == "delete":
            row = ids[:t] + ids[t + 1:]
        else:
            row = list(ids)
            row[t] = tok.mask_token_id if mode == "mask" else tok.unk_token_id
        with torch.no_grad():
            p = torch.softmax(clf.model(input_ids=torch.tensor([row])).logits[0], -1)
        assert ex.scores["leave_one_out"][t] == pytest.approx(0.5 * float((p - p0).abs().sum()), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("model_name", ["clf", "llama"])
def test_attention_is_the_last_layers_row_mean_over_heads(model_name, request):
    loaded = request.getfixturevalue(model_name)
    enc = _enc(loaded)
    att = loaded.model(**enc, output_attentions=True).attentions  # eager: Hugging Face's own maps
    c = enc["input_ids"].shape[1] - 1 if model_name == "llama" else 0
    ex = explain(loaded, TEXT, methods=("attention",), backend="sdpa")
    np.testing.assert_allclose(ex.scores["attention"], att[-1][0, :, c, :].mean(0).detach().numpy(), rtol=1e-6)
    np.testing.assert_allclose(ex.attention_head(0, 1), att[0][0, 1, c, :].detach().numpy(), rtol=1e-6)
    assert tuple(ex.attention_layers.shape) == (2, 4, enc["input_ids"].shape[1])


def _kendall_tau_b(x, y):
    """Kendall's tau-b by counting pairs (the textbook definition)."""
    conc = disc = tx = ty = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
        if dx == 0 and dy == 0:
            continue
        if dx == 0:
            tx += 1
        elif dy == 0:
            ty += 1
        elif dx == dy:
            conc += 1
        else:
            disc += 1
    return (conc - disc) / math.sqrt((conc + disc + tx) * (conc + disc + ty))


def test_agreement_is_kendall_and_spearman_over_non_special_tokens(clf):
    ex = explain(clf, TEXT)
    keep = [i for i, s in enumerate(ex.special) if not s]
    agr = ex.agreement()
    for a, b in itertools.combinations(ex.methods, 2):
        x, y = (np.abs(np.asarray(ex.scores[m])[keep]) for m in (a, b))
        pair = agr[a, b]
        assert pair.n == len(keep)
        assert pair.kendall_tau == pytest.approx(_kendall_tau_b(x, y))
        assert pair.kendall_p == pytest.approx(scipy_stats.kendalltau(x, y).pvalue)
        assert pair.spearman == pytest.approx(scipy_stats.spearmanr(x, y).statistic)
    signed = ex.agreement(magnitude=False, include_special=True)
    x, y = (np.asarray(ex.scores[m]) for m in ("grad_x_input", "integrated_gradients"))
    assert signed["grad_x_input", "integrated_gradients"].kendall_tau == pytest.approx(_kendall_tau_b(x, y))
    assert ex.ranking("attention")[0] not in [i for i, s in enumerate(ex.special) if s]


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_every_backend_gives_the_same_explanation(clf, backend):
    a = explain(clf, TEXT, methods=("gradient", "integrated_gradients", "leave_one_out"), backend="sdpa", ig_steps=8)
    b = explain(clf, TEXT, methods=("gradient", "integrated_gradients", "leave_one_out"), backend=backend, ig_steps=8)
    for m in a.scores:
        np.testing.assert_allclose(a.scores[m], b.scores[m], rtol=1e-6, atol=1e-10)


def test_the_chosen_backend_really_serves_the_gradients(clf, monkeypatch):
    tiled = hb.get("tiled")
    calls = []
    orig = type(tiled).forward

    def spy(self, q, k, v, spec, **kw):
        calls.append(spec.requires_grad)
        return orig(self, q, k, v, spec, **kw)

    monkeypatch.setattr(type(tiled), "forward", spy)
    explain(clf, TEXT, methods=("gradient",), backend="tiled")
    assert calls and any(calls)  # every layer, on the tiled backend, with autograd


def test_similarity_objective_for_a_bare_encoder(encoder):
    with pytest.raises(ModelError, match="compare-to"):
        explain(encoder, TEXT, methods=("gradient",))
    ex = explain(encoder, TEXT, methods=("gradient", "leave_one_out"), compare_to="a dull film")
    enc, ref = encoder.encode(TEXT), encoder.encode("a dull film")

    def pooled(out, m):
        m = m.double()[..., None]
        return (out.last_hidden_state * m).sum(1) / m.sum(1)

    with torch.no_grad():
        r = pooled(encoder.model(**ref), ref["attention_mask"])
        y = torch.nn.functional.cosine_similarity(pooled(encoder.model(**enc), enc["attention_mask"]), r)
    assert ex.kind == "similarity" and ex.y == pytest.approx(float(y)) and ex.probs is None
    ids = enc["input_ids"][0].tolist()
    t = 2
    row = torch.tensor([ids[:t] + ids[t + 1:]])
    with torch.no_grad():
        y_t = torch.nn.functional.cosine_similarity(pooled(encoder.model(input_ids=row), torch.ones_like(row)), r)
    assert ex.scores["leave_one_out"][t] == pytest.approx(abs(float(y - y_t)))


def test_edited_pattern_identity_and_row_replacement(clf):
    enc = _enc(clf)
    obj, _ = make_objective(clf, enc, None, None)
    base = obj.y(enc["input_ids"], enc["attention_mask"])
    with edited_pattern(obj, 1, lambda w: w):
        same = obj.y(enc["input_ids"], enc["attention_mask"])
    torch.testing.assert_close(same, base)
    L = enc["input_ids"].shape[1]
    row = torch.zeros(1, 4, L, dtype=torch.float64)
    row[..., 3] = 1.0  # every head of the last layer reads only token 3 from [CLS]

    seen = {}

    def grab(module, args, output):
        seen["ctx"] = output[0]

    handle = clf.model.bert.encoder.layer[1].attention.self.register_forward_hook(grab)
    try:
        with edited_pattern(obj, 1, replace_row(0, row)):
            obj.y(enc["input_ids"], enc["attention_mask"])
    finally:
        handle.remove()
    v = clf.model.bert.encoder.layer[1].attention.self.value
    with torch.no_grad():
        hidden = clf.model.bert(**enc, output_hidden_states=True).hidden_states[1]  # input of layer 1
        v3 = v(hidden)[0, 3]  # (H*d,): the value of token 3, all heads
    torch.testing.assert_close(seen["ctx"][0, 0].reshape(-1), v3)


# -- bad input ------------------------------------------------------------------------------------------------
def test_bad_input_is_a_typed_error(clf, encoder):
    with pytest.raises(InputError, match="out of range.*3 classes"):
        explain(clf, TEXT, target=3, methods=("gradient",))
    with pytest.raises(ConfigError, match="ig_steps"):
        explain(clf, TEXT, ig_steps=0)
    with pytest.raises(ConfigError, match=r"'integrated_gradient'.*did you mean 'integrated_gradients'.*known methods: "
                                          r"attention, gradient"):
        explain(clf, TEXT, methods=("integrated_gradient",))
    with pytest.raises(ConfigError, match="loo mode"):
        explain(clf, TEXT, loo="drop")
    with pytest.raises(UnknownBackendError):
        explain(clf, TEXT, backend="fast")
    with pytest.raises(InputError, match="at most 64"):
        explain(clf, " ".join(["film"] * 80), methods=("gradient",))
    with pytest.raises(InputError, match="empty"):
        explain(clf, "   ", methods=("gradient",))


def test_completeness_warning_with_too_few_steps(clf):
    from headlab.interpret.saliency import CompletenessWarning

    with pytest.warns(CompletenessWarning, match="completeness gap"):
        ex = explain(clf, TEXT, methods=("integrated_gradients",), ig_steps=1)
    assert ex.completeness_gap > 0.01 and ex.notes


# -- ERASER, counterfactual attention, the study ---------------------------------------------------------------
def test_eraser_by_direct_deletion(clf):
    from headlab.interpret.saliency.faithfulness import AOPC_BINS, eraser

    ex = explain(clf, TEXT, methods=("attention", "integrated_gradients"), ig_steps=8)
    enc = _enc(clf)
    obj, _ = make_objective(clf, enc, None, None)
    got = eraser(obj, enc["input_ids"], enc["attention_mask"], ex.special, ex.scores)
    ids = enc["input_ids"][0].tolist()
    keep = [i for i, s in enumerate(ex.special) if not s]

    def p_target(row):
        with torch.no_grad():
            return float(torch.softmax(clf.model(input_ids=torch.tensor([row])).logits[0], -1)[ex.target])

    p0 = p_target(ids)
    for m in ex.scores:
        order = sorted(keep, key=lambda i: ex.scores[m][i], reverse=True)
        for k in AOPC_BINS:
            top = set(order[:max(1, math.ceil(k * len(keep) / 100))])
            without = [t for i, t in enumerate(ids) if i not in top]
            only = [t for i, t in enumerate(ids) if i in top or ex.special[i]]
            assert got[m].comprehensiveness[k] == pytest.approx(p0 - p_target(without), abs=1e-9)
            assert got[m].sufficiency[k] == pytest.approx(p0 - p_target(only), abs=1e-9)
        assert got[m].aopc_comprehensiveness == pytest.approx(np.mean([got[m].comprehensiveness[k] for k in AOPC_BINS]))
    assert "random" in got


def test_permutation_and_adversarial_attention(clf):
    from scipy.spatial.distance import jensenshannon

    from headlab.interpret.saliency.counterfactual import adversarial_attention, permutation_test
    from headlab.interpret.saliency.occlusion import tvd

    ex = explain(clf, TEXT, methods=("attention",))
    enc = _enc(clf)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    obj, _ = make_objective(clf, enc, None, None)
    row = ex.attention_layers[-1]
    uniform = torch.full_like(row, 1.0 / row.shape[-1])
    # permuting a uniform row changes nothing, but replacing the row by it does
    flat = permutation_test(obj, ids, mask, uniform, n=5)
    with torch.no_grad():
        with edited_pattern(obj, 1, replace_row(0, uniform[None])):
            p_u = obj.y_and_probs(ids, mask)[1]
        p0 = obj.y_and_probs(ids, mask)[1]
    assert flat.median_tvd == pytest.approx(float(tvd(p_u, p0)), abs=1e-9)
    perm = permutation_test(obj, ids, mask, row, n=20)
    assert len(perm.tvds) == 20 and perm.median_tvd == pytest.approx(float(np.median(perm.tvds)))
    assert perm.max_attention == pytest.approx(max(ex.scores["attention"]))
    adv = adversarial_attention(obj, ids, mask, row, budget=0.01, steps=10, restarts=2)
    with torch.no_grad(), edited_pattern(obj, 1, replace_row(0, adv.row[None])):
        p_adv = obj.y_and_probs(ids, mask)[1]
    assert float(tvd(p_adv, p0)) <= 0.01 + 1e-9 and adv.tvd == pytest.approx(float(tvd(p_adv, p0)), abs=1e-6)
    orig, new = row.mean(0).numpy(), adv.row.mean(0).numpy()
    assert adv.max_jsd == pytest.approx(jensenshannon(orig, new) ** 2, rel=1e-6)  # scipy: sqrt(JSD), natural log
    assert adv.max_jsd > 0


def _tsv(tmp_path, body, name="d.tsv"):
    p = tmp_path / name
    p.write_text(body, encoding="utf-8")
    return p


def test_dataset_errors_name_the_problem(tmp_path):
    from headlab.interpret.saliency import read_dataset

    with pytest.raises(InputError, match="no column label.*header has"):
        read_dataset(_tsv(tmp_path, "sentence\tscore\na film\t1\n"))
    with pytest.raises(InputError, match="no column sentence"):
        read_dataset(_tsv(tmp_path, "words\tlabel\na film\t1\n"))
    with pytest.raises(InputError, match="line 3: empty row"):
        read_dataset(_tsv(tmp_path, "sentence\tlabel\na film\t1\n\t\nfine\t0\n"))
    with pytest.raises(InputError, match="line 2: label 'x'"):
        read_dataset(_tsv(tmp_path, "sentence\tlabel\na film\tx\n"))
    with pytest.raises(InputError, match="no dataset file"):
        read_dataset(tmp_path / "missing.tsv")
    rows = read_dataset(_tsv(tmp_path, "sentence\tlabel\na film\t1\nbad\t0\n"))
    assert [(r.line, r.text, r.label) for r in rows] == [(2, "a film", 1), (3, "bad", 0)]


def test_study_tables_and_resume(clf, tmp_path):
    from headlab.interpret.saliency import StudyOptions, study

    data = _tsv(tmp_path, "sentence\tlabel\na gripping film\t1\na dull , tired film\t0\n")
    opts = StudyOptions(methods=("attention", "gradient", "integrated_gradients"), ig_steps=4, permutations=6,
                        adversarial_steps=2, bootstrap=50)
    def units():  # the records, by row key: the explain instrument's units file (its runner resumes from it)
        return __import__("json").loads((tmp_path / "out" / "instances.json").read_text())["units"]

    r = study(clf, data, tmp_path / "out", limit=1, options=opts, progress=False)
    assert r.instances == 1 and (tmp_path / "out" / "tau_hist.png").is_file()
    assert len(units()) == 1
    r2 = study(clf, data, tmp_path / "out", options=opts, progress=False)  # the earlier files are replaced
    assert r2.instances == 2 and len(units()) == 2
    recs = list(units().values())
    taus = [x["tau"]["attention|gradient"][0] for x in recs]
    assert r2.tables["kendall"]["gradient"]["mean"] == pytest.approx(np.mean([t for t in taus if t is not None]))
    acc = np.mean([x["pred"] == x["label"] for x in recs])
    assert r2.tables["accuracy"] == pytest.approx(acc)
    f = r2.tables["faithfulness"]["integrated_gradients"]["comprehensiveness@20"]
    vals = [x["eraser"]["integrated_gradients"]["comprehensiveness"]["20"] for x in recs]
    assert f["mean"] == pytest.approx(np.mean(vals)) and f["lo"] <= f["mean"] <= f["hi"]
    # a run with one more method explains both rows again: records of two method sets are never mixed
    more = StudyOptions(methods=opts.methods + ("grad_x_input",), ig_steps=4, permutations=6, adversarial_steps=2,
                        bootstrap=50)
    r3 = study(clf, data, tmp_path / "out", options=more, progress=False)
    assert r3.instances == 2 and all("grad_x_input" in u["scores"] for u in units().values())
    assert "grad_x_input" in r3.tables["kendall"]


# -- the command line --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clf_dir(clf, tmp_path_factory):
    d = tmp_path_factory.mktemp("clf")
    clf.model.float().save_pretrained(d)
    clf.model.double()
    clf.tokenizer.save_pretrained(d)
    return d


def test_cli_help_and_errors(clf_dir, tmp_path, capsys):
    from conftest import run_cli

    code, out, _ = run_cli(["explain", "--help"], capsys)
    assert code == 0 and "--dataset" in out and "--compare-to" in out
    cases = [
        (["explain", TEXT, "--model", clf_dir, "--methods", "gradient,integratedgradients"], "known methods"),
        (["explain", TEXT, "--model", clf_dir, "--target", "7"], "out of range"),
        (["explain", TEXT, "--model", clf_dir, "--ig-steps", "0"], "ig_steps"),
        (["explain", "--model", clf_dir], "no text"),
        (["explain", "--dataset", _tsv(tmp_path, "text\tscore\nx\t1\n"), "--model", clf_dir, "--out", tmp_path / "o"],
         "no column label"),
        (["explain", TEXT, "--model", tmp_path / "nothing-here"], "unknown model"),
    ]
    for args, msg in cases:
        code, _, err = run_cli(args, capsys)
        assert code == 2 and msg in err and len(err.strip().splitlines()) <= 3, (args, err)


def test_cli_json_and_html(clf_dir, tmp_path, capsys):
    import json

    from conftest import run_cli

    code, out, _ = run_cli(["explain", TEXT, "--model", clf_dir, "--methods", "attention,gradient,leave_one_out",
                            "--json", "--out", tmp_path / "ex"], capsys)
    assert code == 0
    j = json.loads(out)
    assert set(j) >= {"tokens", "target", "probs", "scores", "agreement", "completeness_gap"}
    assert list(j["scores"]) == ["attention", "gradient", "leave_one_out"] and len(j["tokens"]) == len(j["scores"]["gradient"])
    page = (tmp_path / "ex" / "explanation.html").read_text()
    assert "<link" not in page and "src=" not in page and page.count('class="panel"') == 3
    assert (tmp_path / "ex" / "explanation.png").stat().st_size > 1000
    code, out, _ = run_cli(["explain", TEXT, "--model", clf_dir, "--methods", "gradient,grad_x_input"], capsys)
    assert code == 0 and "grad*input" in out and "Kendall" in out


@pytest.mark.browser
def test_explanation_page_in_a_headless_browser(clf, tmp_path):
    import subprocess

    from conftest import require_browser
    from headlab.interpret.saliency.html import write_explanation

    browser = require_browser()
    ex = explain(clf, TEXT, ig_steps=8)
    page = write_explanation(ex, tmp_path / "ex")["html"]
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--disable-extensions", "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}",
           "--virtual-time-budget=2000", "--dump-dom", f"{page.as_uri()}#selftest"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert '<pre id="selftest">selftest: pass</pre>' in proc.stdout, proc.stdout[-2000:]
    assert not [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]


def test_head_annotations_rank_each_head_against_ig(clf, tmp_path):
    from headlab.interpret.saliency.annotations import head_annotations, head_taus
    from headlab.interpret.saliency.html import write_explanation

    ex = explain(clf, TEXT, methods=("attention", "integrated_gradients"), ig_steps=8)
    taus = head_taus(ex)
    assert set(taus) == {(l, h) for l in range(2) for h in range(4)}
    keep = [i for i, s in enumerate(ex.special) if not s]
    row = np.asarray(ex.attention_head(1, 2))[keep]
    ig = np.abs(np.asarray(ex.scores["integrated_gradients"]))[keep]
    assert taus[(1, 2)][0] == pytest.approx(_kendall_tau_b(row, ig))
    write_explanation(ex, tmp_path / "ex")
    notes = head_annotations(tmp_path / "ex")
    assert notes[(1, 2)].startswith("tau with IG") and notes == head_annotations(ex)
    with pytest.raises(InputError, match="needs an explanation"):
        head_annotations(explain(clf, TEXT, methods=("gradient",)))


def test_analyze_report_gains_the_saliency_strip(clf, encoder, tmp_path):
    from headlab.interpret.report.analyze_job import analyze

    r = analyze(TEXT, model=clf, out_dir=tmp_path / "rep")
    assert (tmp_path / "rep" / "saliency.png").is_file() and (tmp_path / "rep" / "saliency.html").is_file()
    assert any("saliency" in n for n in r.notes)
    assert all(rec.evidence and rec.evidence[-1].startswith("tau with IG") for rec in r.records)
    # the strip is inside the report itself: one panel per method, tokens shaded as on the explain page
    page = (tmp_path / "rep" / "report.html").read_text()
    section = page[page.index('<section id="saliency-section">'):]
    section = section[:section.index("</section>")]
    alone = (tmp_path / "rep" / "saliency.html").read_text()
    methods = re.findall(r'data-method="([a-z_]+)"', alone)
    assert methods and re.findall(r'data-method="([a-z_]+)"', section) == methods
    assert section.count('class="tok"') == alone.count('class="tok"') > 0 and "Kendall tau" in section
    analyze(TEXT, model=encoder, out_dir=tmp_path / "enc")  # no head to explain: no strip, no files
    assert 'id="saliency-section"' not in (tmp_path / "enc" / "report.html").read_text()
    assert not (tmp_path / "enc" / "saliency.html").exists()
