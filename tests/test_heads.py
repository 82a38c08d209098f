"""Head importance, ablation and pruning, each against an independent computation of its definition.

- importance == the finite-difference derivative of each example's loss w.r.t. each gate, |.|, averaged;
- each ablation kind == a hand-written forward of headlab's Transformer with that head's z (or pattern)
  replaced by the definition (zero, mean over the set, another example's z, uniform attention);
- a physically pruned model == the gated original within 1e-5, and reloads (BERT-style, GPT-2,
  GQA Llama-style, headlab's own), saving a stock Hugging Face folder when layers agree;
- bad input raises typed errors; the CLI exits 2.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

import headlab
from headlab.errors import ConfigError, InputError, PruneError
from headlab.interpret.heads import examples as C
from headlab.interpret.heads.ablation import ablate, linear_cka
from headlab.interpret.heads.importance import correlate, head_confidence, head_importance
from headlab.models import adapt
from headlab.models.transformer import Transformer, TransformerConfig

V = 40


def _texts(n=7, lo=4, hi=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(k),), generator=g) for k in torch.randint(lo, hi, (n,), generator=g)]


def _decoder(kv=2, layers=2, dtype=torch.float64):
    torch.manual_seed(1)
    m = Transformer(TransformerConfig(vocab_size=V, d_model=32, n_layers=layers, n_heads=4, n_kv_heads=kv, causal=True))
    with torch.no_grad():  # larger weights than the 0.02 init, so heads matter
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return m.to(dtype).eval()


# -- importance ---------------------------------------------------------------------------------------------------
def _fd_importance(m, texts, loss, labels=None, eps=1e-5, ref_fn=None):
    a = adapt(m)
    a.gates = torch.ones(a.n_layers, a.n_heads, dtype=torch.float64)
    out = torch.zeros(a.n_layers, a.n_heads, dtype=torch.float64)
    for i, t in enumerate(texts):
        b = C.batches(None, a, [t], None if labels is None else [labels[i]], 1)[0]
        ref = ref_fn(i) if ref_fn else {}
        for l in range(a.n_layers):
            for h in range(a.n_heads):
                vals = []
                for s in (eps, -eps):
                    a.gates[l, h] = 1 + s
                    with torch.no_grad():
                        vals.append(float(C.per_example(loss, m(**b.inputs), b, ref, surrogate=True)))
                a.gates[l, h] = 1.0
                out[l, h] += abs(vals[0] - vals[1]) / (2 * eps)
    a.reset_gates()
    return (out / len(texts)).float()


def test_importance_equals_finite_differences_lm():
    m, texts = _decoder(), _texts()
    got = head_importance(m, texts, loss="lm", batch_size=3)
    want = _fd_importance(m, texts, "lm")
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-7), (got, want)
    assert float(got.min()) > 0


def test_importance_is_mean_of_absolute_not_absolute_of_mean():
    m, texts = _decoder(), _texts()
    imp = head_importance(m, texts, loss="lm", batch_size=7)
    # the gradient of the mean loss (one scalar backward) is smaller in |.| wherever examples disagree in sign
    a = adapt(m)
    a.gates = torch.ones(2, 4, dtype=torch.float64, requires_grad=True)
    b = C.batches(None, a, texts, None, 7)[0]
    C.per_example("lm", m(**b.inputs), b, {}).mean().backward()
    of_mean = a.gates.grad.abs().float()
    a.reset_gates()
    assert bool((imp >= of_mean - 1e-7).all()) and bool((imp > of_mean + 1e-6).any())


def test_importance_task_loss_and_normalize():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=3)
    m = transformers.BertForSequenceClassification(cfg).double().eval()
    texts, labels = _texts(5), [0, 2, 1, 1, 0]
    got = head_importance(m, texts, labels, loss="task", batch_size=2)
    want = _fd_importance(m, texts, "task", labels)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-8)
    norm = head_importance(m, texts, labels, loss="task", normalize=True)
    assert torch.allclose(norm.norm(dim=-1), torch.ones(2, dtype=norm.dtype), atol=1e-6)
    assert torch.allclose(norm, got / got.norm(dim=-1, keepdim=True), rtol=1e-5)


def test_label_free_surrogates_equal_finite_differences():
    # kl: -log p(y*) with y* drawn from the unpruned distribution (seeded); rebuild the same draws
    m, texts = _decoder(), _texts(4)
    got = head_importance(m, texts, loss="kl", batch_size=1, seed=3)
    gen = torch.Generator().manual_seed(3)
    a = adapt(m)
    refs = []
    for t in texts:
        b = C.batches(None, a, [t], None, 1)[0]
        with torch.no_grad():
            refs.append(C.reference("kl", m(**b.inputs), b, generator=gen))
    want = _fd_importance(m, texts, "kl", ref_fn=lambda i: refs[i])
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-8)


def test_kl_and_cosine_are_flat_at_the_unpruned_model():
    # why the surrogates exist: the true label-free losses have zero derivative at gates = 1
    m, texts = _decoder(), _texts(2)
    a = adapt(m)
    b = C.batches(None, a, texts[:1], None, 1)[0]
    with torch.no_grad():
        ref = C.reference("kl", m(**b.inputs), b)
    a.gates = torch.ones(2, 4, dtype=torch.float64, requires_grad=True)
    C.per_example("kl", m(**b.inputs), b, ref).sum().backward()
    assert float(a.gates.grad.abs().max()) < 1e-10
    a.reset_gates()


def test_confidence_equals_mean_max_weight_of_the_maps():
    m, texts = _decoder(), _texts(3)
    conf = head_confidence(m, texts, batch_size=2)
    a = adapt(m)
    want = torch.zeros(2, 4, dtype=torch.float64)
    n = 0
    for t in texts:
        cache = headlab.capture(m, t[None], "blocks.*.attn.pattern")
        for l in range(2):
            want[l] += cache[f"blocks.{l}.attn.pattern"][0].max(-1).values.sum(-1)
        n += len(t)
    assert torch.allclose(conf.double(), want / n, atol=1e-6)
    assert a.n_layers == 2


def test_correlate_is_spearman():
    from scipy.stats import spearmanr

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    got = correlate(a=x, b=y)["a~b"]
    assert got == pytest.approx(spearmanr(x.flatten(), y.flatten()).statistic, abs=1e-12)


# -- ablation: every kind against a hand-written forward ---------------------------------------------------------
def _manual(m, ids, edit=None):
    """headlab Transformer by hand for one sequence; ``edit(layer, z (H, L, d), P (H, L, L), v) -> z``."""
    cfg = m.config
    L = len(ids)
    x = m.tok_emb.weight[ids] + m.pos_emb.weight[:L]
    zs = []
    for li, blk in enumerate(m.blocks):
        at = blk.attn
        H, Hkv, d = at.num_heads, at.num_kv_heads, at.head_dim
        h = F.layer_norm(x, (cfg.d_model,), blk.ln1.weight, blk.ln1.bias)
        q = (h @ at.q_proj.weight.T + at.q_proj.bias).view(L, H, d).transpose(0, 1)
        k = (h @ at.k_proj.weight.T + at.k_proj.bias).view(L, Hkv, d).transpose(0, 1)
        v = (h @ at.v_proj.weight.T + at.v_proj.bias).view(L, Hkv, d).transpose(0, 1)
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
        s = q @ k.transpose(-1, -2) / math.sqrt(d)
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        P = s.softmax(-1)
        z = P @ v  # (H, L, d)
        zs.append(z)
        if edit is not None:
            z = edit(li, z, P, v)
        x = x + z.transpose(0, 1).reshape(L, H * d) @ at.out_proj.weight.T + at.out_proj.bias
        x = x + blk.mlp(F.layer_norm(x, (cfg.d_model,), blk.ln2.weight, blk.ln2.bias))
    logits = F.layer_norm(x, (cfg.d_model,), m.ln_f.weight, m.ln_f.bias) @ m.tok_emb.weight.T
    nll = F.cross_entropy(logits[:-1], ids[1:])
    return float(nll), zs


def _replace(layer, head, value_fn):
    def edit(li, z, P, v):
        if li != layer:
            return z
        z = z.clone()
        z[head] = value_fn(z, P, v)
        return z
    return edit


KIND_CASES = {  # kind -> the replacement of z_h by its definition, given (texts, clean z's, example i)
    "zero": lambda z, P, v, ctx: torch.zeros_like(z[ctx["h"]]),
    "mean": lambda z, P, v, ctx: ctx["mean"].expand_as(z[ctx["h"]]),
    "resample": lambda z, P, v, ctx: ctx["donor"],
    "uniform": lambda z, P, v, ctx: (torch.ones_like(P[ctx["h"]]).tril() /
                                     torch.arange(1, P.shape[-1] + 1, dtype=P.dtype)[:, None]) @ v[ctx["h"]],
}


@pytest.mark.parametrize("kind", list(KIND_CASES))
def test_each_ablation_kind_equals_its_definition(kind):
    m, texts = _decoder(), _texts(6, lo=4, hi=9, seed=2)
    batch = 3
    res = ablate(m, texts, kind=kind, loss="lm", batch_size=batch, k=3, keep_one=False, n_boot=50, cka=False)
    with torch.no_grad():
        clean = [_manual(m, t) for t in texts]
        for (layer, head) in [(0, 1), (1, 3)]:
            all_z = torch.cat([zs[layer][head] for _, zs in clean], 0)  # every token of the set
            effects = []
            for i, t in enumerate(texts):
                start = (i // batch) * batch
                j = start + ((i - start) + 1) % batch  # the next example of its batch, cyclically
                dz = clean[j][1][layer][head]
                pos = torch.clamp(torch.arange(len(t)), max=len(texts[j]) - 1)
                ctx = {"h": head, "mean": all_z.mean(0), "donor": dz[pos]}
                edit = _replace(layer, head, lambda z, P, v: KIND_CASES[kind](z, P, v, ctx))
                effects.append(_manual(m, t, edit)[0] - clean[i][0])
            assert float(res.single[layer, head]) == pytest.approx(np.mean(effects), rel=1e-6, abs=1e-9), kind


def test_zero_ablation_equals_gate_zero_and_pairs_are_joint():
    m, texts = _decoder(), _texts(5)
    res = ablate(m, texts, kind="zero", loss="lm", k=3, pairs=[((0, 0), (1, 2))], n_boot=100)
    a = adapt(m)

    def mean_loss():
        b = C.batches(None, a, texts, None, 16)[0]
        with torch.no_grad():
            return C.per_example("lm", m(**b.inputs), b, {})

    base = mean_loss()
    a.gates[0, 0] = 0
    e00 = float((mean_loss() - base).mean())
    a.gates[1, 2] = 0
    e_pair = float((mean_loss() - base).mean())
    a.reset_gates()
    assert float(res.single[0, 0]) == pytest.approx(e00, rel=1e-6, abs=1e-10)
    i, j = res.pair_heads.index((0, 0)), res.pair_heads.index((1, 2))
    assert float(res.pair_effect[i, j]) == pytest.approx(e_pair, rel=1e-6, abs=1e-10)
    assert float(res.interaction[i, j]) == pytest.approx(e_pair - e00 - float(res.single[1, 2]), rel=1e-5)
    lo, hi = res.single_ci[0, 0]
    assert lo <= res.single[0, 0] <= hi
    # keep-one-per-layer: layer 1 reduced to head 0 == gates of heads 1..3 at 0
    a.gates[1, 1:] = 0
    e_keep = float((mean_loss() - base).mean())
    a.reset_gates()
    assert float(res.keep_one[1, 0]) == pytest.approx(e_keep, rel=1e-6, abs=1e-10)


def test_a_silent_head_is_unused_and_copies_have_cka_one():
    # a 1-layer model where head 1 is a copy of head 0 (same q, k, v, W_O blocks), head 3 writes nothing
    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=4, causal=True)).double().eval()
    at = m.blocks[0].attn
    d = at.head_dim
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.4)
        for lin in (at.q_proj, at.k_proj, at.v_proj):
            lin.weight[d:2 * d] = lin.weight[:d]
            lin.bias[d:2 * d] = lin.bias[:d]
        at.out_proj.weight[:, :d] *= 1.0
        at.out_proj.weight[:, d:2 * d] = at.out_proj.weight[:, :d]
        at.out_proj.weight[:, 3 * d:] = 0.0
    texts = _texts(40, 5, 12, seed=5)
    res = ablate(m, texts, kind="zero", loss="kl", k=4, n_boot=300, rel_tol=0.02)
    v3 = res.verdict_of(0, 3)
    assert v3.verdict == "unused", v3
    # zero in exact arithmetic; in float64 the ablated and clean rows go through GEMMs of other
    # shapes, whose summation order may differ by an ulp on some BLAS builds (seen: -1e-18)
    assert abs(float(res.single[0, 3])) < 1e-12
    i, j = res.pair_heads.index((0, 0)), res.pair_heads.index((0, 1))
    assert res.cka[i, j] == pytest.approx(1.0, abs=1e-9)  # identical outputs
    assert float(linear_cka(torch.randn(50, 4), torch.randn(50, 4), torch.randn(4, 6), torch.randn(4, 6))) < 1


def test_verdict_rule_on_known_effects():
    from headlab.interpret.heads.ablation import _verdicts

    heads = [(0, 0), (0, 1), (0, 2), (0, 3)]
    single = torch.tensor([[0.001, 0.002, 0.5, 0.0]])
    ci = torch.tensor([[[-0.01, 0.012], [-0.01, 0.014], [0.4, 0.6], [-0.001, 0.001]]])
    pair_heads = [(0, 0), (0, 1), (0, 3)]
    inter = torch.tensor([[float("nan"), 0.3, 0.0], [0.3, float("nan"), 0.001], [0.0, 0.001, float("nan")]])
    inter_ci = torch.stack([inter - 0.05, inter + 0.05], -1)
    cka = torch.full((3, 3), 0.9)
    v = {(x.layer, x.head): x for x in _verdicts(heads, single, ci, pair_heads, inter, inter_ci, cka, thr=0.05)}
    assert v[(0, 0)].label() == "redundant with 0.1" and "CKA(head_out)=0.90" in v[(0, 0)].evidence
    assert v[(0, 1)].label() == "redundant with 0.0"
    assert v[(0, 2)].verdict == "unique"
    assert v[(0, 3)].verdict == "unused"
    # an interaction above the threshold but with an interval reaching 0 is not evidence
    inter_ci[0, 1, 0] = inter_ci[1, 0, 0] = -0.01
    v = {(x.layer, x.head): x for x in _verdicts(heads, single, ci, pair_heads, inter, inter_ci, cka, thr=0.05)}
    assert v[(0, 0)].verdict == "unused"


def test_linear_cka_matches_the_direct_formula():
    zx, zy, wx, wy = (torch.randn(s, dtype=torch.float64) for s in ((60, 4), (60, 4), (4, 10), (4, 10)))
    X, Y = (zx @ wx).double(), (zy @ wy).double()
    X, Y = X - X.mean(0), Y - Y.mean(0)
    want = (X.T @ Y).norm() ** 2 / ((X.T @ X).norm() * (Y.T @ Y).norm())
    assert linear_cka(zx, zy, wx, wy) == pytest.approx(float(want), rel=1e-9)


# -- physical pruning ---------------------------------------------------------------------------------------------
def _bert():
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                          num_attention_heads=4, intermediate_size=64,
                                                          max_position_embeddings=32)).eval()


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=32)).eval()


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                                                                n_positions=32, bos_token_id=0,
                                                                eos_token_id=0)).eval()


def _out(o):
    lg = getattr(o, "logits", None)
    return lg if lg is not None else o.last_hidden_state


PRUNE_CASES = {  # name: (model builder, heads to remove, kwargs, expected heads per layer)
    "bert": (_bert, {0: [1, 2], 1: [0]}, {}, [2, 3]),
    "gpt2": (_gpt2, {0: [3], 1: [0, 1, 2]}, {}, [3, 1]),
    "llama-whole-groups": (_llama, {0: [0, 1, 2], 1: [3, 4, 5]}, {}, [3, 3]),
    "llama-uneven-padded": (_llama, {0: [0, 1], 1: [4]}, {}, [6, 6]),
    "llama-empty-layer": (_llama, {1: list(range(6))}, {"allow_empty_layers": True}, [6, 1]),
    "headlab-gqa": (lambda: _decoder(dtype=torch.float32), {0: [2, 3], 1: [1]}, {}, [2, 4]),
}


@pytest.mark.parametrize("case", list(PRUNE_CASES))
def test_pruned_equals_gated_and_reloads(case, tmp_path):
    build, heads, kw, per_layer = PRUNE_CASES[case]
    m = build()
    ids = torch.randint(0, V, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    p = headlab.prune_heads(m, heads, **kw)
    assert p.adapter.layer_heads == per_layer
    a = adapt(m)
    assert bool((a.gates == 1).all())  # the input is untouched
    for l, hs in heads.items():
        a.gates[l, hs] = 0
    with torch.no_grad():
        want, got = _out(m(input_ids=ids, attention_mask=mask)), _out(p.model(input_ids=ids, attention_mask=mask))
    a.reset_gates()
    assert (got - want).abs().max() <= 1e-5
    n_params = sum(t.numel() for t in p.model.parameters())
    assert n_params < sum(t.numel() for t in m.parameters()) or case == "llama-uneven-padded"
    p.save(tmp_path / "pruned")
    q = headlab.load(tmp_path / "pruned")
    with torch.no_grad():
        again = _out(q.model(input_ids=ids, attention_mask=mask))
    assert (again - got).abs().max() <= 1e-5
    assert q.adapter.layer_heads == per_layer
    manifest = json.loads((tmp_path / "pruned" / "headlab_pruned.json").read_text())
    assert manifest["stock_hf"] == (case.startswith("llama") and len(set(per_layer)) == 1)
    if manifest["stock_hf"]:  # a plain Hugging Face folder that stock transformers opens
        s = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned")
        with torch.no_grad():
            assert (_out(s(input_ids=ids, attention_mask=mask)) - got).abs().max() <= 1e-5
    if case == "llama-uneven-padded":
        assert p.notes and "zero-output padding" in p.notes[0]


def test_pruned_model_reports_its_heads_to_capture_and_gates():
    m = _bert()
    p = headlab.prune_heads(m, {0: [0]})
    ids = torch.randint(0, V, (1, 6))
    cache = headlab.capture(p.model, ids, ["blocks.0.attn.z", "blocks.1.attn.z"])
    assert cache["blocks.0.attn.z"].shape[1] == 3 and cache["blocks.1.attn.z"].shape[1] == 4
    imp = head_importance(p, [ids[0]], loss="cosine")
    assert imp.shape == (2, 4) and math.isnan(float(imp[0, 3])) and not math.isnan(float(imp[1, 3]))


def test_gqa_strict_refuses_uneven_groups_and_pad_is_exact():
    m = _llama()
    with pytest.raises(PruneError, match="groups of"):
        headlab.prune_heads(m, {0: [0]}, gqa="strict")
    headlab.prune_heads(m, {0: [0, 1, 2]}, gqa="strict")  # a whole group: fine


BAD_PRUNES = {
    "layer out of range": ({5: [0]}, {}, ConfigError, "layer 5"),
    "head out of range": ({0: [9]}, {}, ConfigError, "head 9"),
    "duplicate head": ({0: [1, 1]}, {}, ConfigError, "twice"),
    "whole layer without flag": ({0: [0, 1, 2, 3]}, {}, PruneError, "allow_empty_layers"),
    "not a dict": ([0, 1], {}, ConfigError, "dict"),
}


@pytest.mark.parametrize("case", list(BAD_PRUNES))
def test_bad_prunes_are_typed_errors(case):
    heads, kw, err, msg = BAD_PRUNES[case]
    with pytest.raises(err, match=msg):
        headlab.prune_heads(_bert(), heads, **kw)


def test_bad_inputs_are_typed_errors():
    m = _decoder()
    with pytest.raises(InputError, match="labels"):
        head_importance(m, _texts(2), loss="task")
    with pytest.raises(InputError, match="empty"):
        head_importance(m, [], loss="lm")
    with pytest.raises(ConfigError, match="unknown ablation kind"):
        ablate(m, _texts(2), kind="noise", loss="lm")
    with pytest.raises(ConfigError, match="out of range"):
        ablate(m, _texts(2), heads=[(0, 7)], loss="lm")
    with pytest.raises(ConfigError, match="decoder"):
        head_importance(_bert(), _texts(2), loss="lm")
    with pytest.raises(InputError, match="at least 2"):
        ablate(m, _texts(1), kind="resample", loss="lm")
    a = adapt(m)
    with pytest.raises(ConfigError, match="shape"):
        a.gates = torch.ones(3, 4)


def test_uniform_kind_equals_a_uniform_pattern_edit():
    # the z-side implementation (mean of visible values) against editing the pattern itself at its hook site
    m, texts = _decoder(), _texts(4, lo=5, hi=8, seed=4)
    res = ablate(m, texts, kind="uniform", loss="lm", heads=[(1, 2)], k=2, pairs=[], keep_one=False, n_boot=20)
    a = adapt(m)

    def uniform(p, site):
        p = p.clone()
        vis = torch.ones_like(p[:, 2]).tril()
        p[:, 2] = vis / vis.sum(-1, keepdim=True)
        return p

    eff = []
    for t in texts:
        b = C.batches(None, a, [t], None, 1)[0]
        with torch.no_grad():
            base = C.per_example("lm", m(**b.inputs), b, {})
            with a.hooks({"blocks.1.attn.pattern": uniform}):
                edited = C.per_example("lm", m(**b.inputs), b, {})
        eff.append(float(edited - base))
    assert float(res.single[1, 2]) == pytest.approx(np.mean(eff), rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
def test_importance_on_fused_backends_equals_reference(backend):
    m, texts = _decoder(dtype=torch.float32), _texts(4)
    ref = head_importance(m, texts, loss="lm", backend="reference")
    got = head_importance(m, texts, loss="lm", backend=backend)
    assert torch.allclose(got, ref, rtol=1e-3, atol=1e-6)
