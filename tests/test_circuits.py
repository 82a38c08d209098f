"""The circuits room's core: the graph, exact edge patching, EAP and EAP-IG, each against an independent computation.

- the edge count against the closed form and a brute-force enumeration of "sender before receiver";
- exact edge patching of one edge (two stacked forwards) against the split forward that patches edge sets;
- patching every outgoing edge of a node against :func:`headlab.patch` of the node; all edges against the
  corrupted run, none against the clean one;
- EAP against the first-order change of exact patching (a corruption scaled by eps: the error falls as eps^2);
- EAP-IG: one step is EAP; with the activations interpolated, the logits' edges add up to the whole
  clean-to-corrupted change (completeness) as the steps grow, the error falling like 1/steps.
"""

from __future__ import annotations

import pytest
import torch

import headlab
from headlab.errors import ConfigError, HeadlabError, UnsupportedArchitectureError
from headlab.interpret.circuits import edge_patch, edge_scores, graph, patched_metric
from headlab.interpret.circuits import nodes
from headlab.interpret.patching import logit_diff, runs
from headlab.models.transformer import Transformer, TransformerConfig
from tests import architectures as arch

CLEAN = torch.tensor([[1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8]])
CORRUPT = torch.tensor([[1, 9, 3, 4, 5, 6], [3, 11, 5, 6, 7, 8]])


def tiny(kv=2, layers=3, seed=0):
    torch.manual_seed(seed)
    return Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=layers, n_heads=4, n_kv_heads=kv,
                                         causal=True)).eval().double()


def hf(name):
    return arch.build(name).double()


def brute_edges(g):
    """Every (sender, receiver) pair where the sender has run before the receiver reads the stream."""
    order = {"input": (-1, 0)}
    for l, H in enumerate(g.heads):
        for h in range(H):
            order[f"a{l}.h{h}"] = (l, 0)
        order[f"m{l}"] = (l, 1)
    out = []
    for r in g.receivers:
        for s, (sl, sp) in order.items():
            if r.kind == "logits":
                ok = True
            elif r.kind == "mlp":
                ok = sl < r.layer or (sl == r.layer and sp == 0 and not g.parallel[r.layer])
            else:
                ok = sl < r.layer
            if ok:
                out.append(f"{s}->{r.name}")
    return out


@pytest.mark.parametrize("make", [lambda: tiny(kv=4), lambda: tiny(kv=2), lambda: tiny(kv=1, layers=2),
                                  lambda: hf("llama"), lambda: hf("gpt_neox"), lambda: hf("gpt2")],
                         ids=["mha", "gqa", "mqa", "llama", "gpt_neox-parallel", "gpt2"])
def test_edge_count(make):
    g = graph(make())
    assert g.n_edges == g.formula() == len(set(g.edges))
    assert sorted(g.edges) == sorted(brute_edges(g))
    assert g.n_nodes == 1 + sum(g.heads) + g.n_layers + 1


def test_names_follow_eap_ig():
    g = graph(tiny(kv=2))
    assert "input->a0.h3<q>" in g.edges and "a0.h1->a2.h1<k>" in g.edges and "a1.h2->logits" in g.edges
    assert "a0.h1->a2.h2<k>" not in g.edges  # 2 kv heads: k receivers are a2.h0<k>, a2.h1<k>
    assert "a1.h0->m1" in g.edges and "m1->a1.h0<q>" not in g.edges
    assert graph(hf("gpt_neox")).parallel == [True, True]
    assert "a0.h0->m0" not in graph(hf("gpt_neox")).edges  # a parallel MLP reads what its heads read
    with pytest.raises(ConfigError, match="not an edge"):
        g.edge_index("a2.h0->a1.h0<q>")


def test_post_norm_refused():
    with pytest.raises(UnsupportedArchitectureError, match="normalises after attention"):
        graph(arch.build("bert"))


def _setup(m, clean=CLEAN, corrupt=CORRUPT):
    pair = runs.prepare(m, clean, corrupt)
    g = graph(m)
    with torch.no_grad():
        ko, _ = nodes.record(pair, g, pair.corrupted)
    return pair, g, ko


CASES = {"tiny-gqa": (lambda: tiny(kv=2), CLEAN, CORRUPT),
         "llama": (lambda: hf("llama"), CLEAN + 10, CORRUPT + 10),
         "gpt_neox": (lambda: hf("gpt_neox"), CLEAN + 10, CORRUPT + 10)}


@pytest.mark.parametrize("case", list(CASES))
def test_one_edge_two_ways(case):
    make, clean, corrupt = CASES[case]
    m = make()
    metric = logit_diff(2, 5)
    exact = edge_patch(m, clean, corrupt, metric)
    pair, g, ko = _setup(m, clean, corrupt)
    gen = torch.Generator().manual_seed(0)
    picks = torch.randperm(g.n_edges, generator=gen)[:12].tolist() + [0, g.n_edges - 1]
    for i in picks:
        mask = torch.zeros(g.n_edges, dtype=torch.bool)
        mask[i] = True
        split = float(patched_metric(pair, g, metric, mask, ko).mean()) - exact.clean
        assert split == pytest.approx(float(exact.values[i]), abs=1e-7), g.edges[i]
    everything = torch.ones(g.n_edges, dtype=torch.bool)
    assert float(patched_metric(pair, g, metric, everything, ko).mean()) == pytest.approx(exact.corrupted, abs=1e-7)
    assert float(patched_metric(pair, g, metric, ~everything, ko).mean()) == pytest.approx(exact.clean, abs=1e-7)


@pytest.mark.parametrize("case", list(CASES))
def test_all_outgoing_edges_equal_the_node(case):
    make, clean, corrupt = CASES[case]
    m = make()
    metric = logit_diff(2, 5)
    node = headlab.patch(m, clean, corrupt, metric, sites=["z", "mlp_out"])
    pair, g, ko = _setup(m, clean, corrupt)
    m_clean = node.clean
    for s in ["a0.h1", "a1.h3", "m0", "m1"]:
        mask = torch.tensor([e.split("->")[0] == s for e in g.edges])
        got = float(patched_metric(pair, g, metric, mask, ko).mean()) - m_clean
        l = int(s[1])
        want = float(node.raw["z"][l, int(s[-1])]) if s.startswith("a") else float(node.raw["mlp_out"][l, 0])
        assert got == pytest.approx(want, abs=1e-6), s


def _small_corruption(m, eps):
    """Token 9's embedding made token 2's plus eps * u: the pair differs by a corruption of size eps."""
    emb = m.get_input_embeddings() if hasattr(m, "get_input_embeddings") else m.tok_emb
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        emb.weight[9] = emb.weight[2] + eps * torch.randn(emb.weight.shape[1], generator=gen, dtype=emb.weight.dtype)
    return torch.tensor([[1, 2, 3, 4, 5, 6]]), torch.tensor([[1, 9, 3, 4, 5, 6]])


@pytest.mark.parametrize("make", [lambda: tiny(kv=2), lambda: hf("llama"), lambda: hf("gpt_neox")],
                         ids=["tiny-gqa", "llama", "gpt_neox"])
def test_eap_is_the_first_order_change(make):
    errors = []
    for eps in (1e-3, 1e-4):
        m = make()
        clean, corrupt = _small_corruption(m, eps)
        metric = logit_diff(2, 5)
        eap = edge_scores(m, clean, corrupt, metric)
        exact = edge_patch(m, clean, corrupt, metric)
        scale = float(exact.values.abs().max())
        assert scale > 0
        errors.append(float((eap.values - exact.values).abs().max()) / scale)
    assert errors[1] < 5e-3
    assert errors[1] < errors[0] / 5  # second order: 10x smaller eps, ~10x smaller relative error


def test_eap_ig_one_step():
    m = tiny(kv=2)
    metric = logit_diff(2, 5)
    eap = edge_scores(m, CLEAN, CORRUPT, metric)
    act = edge_scores(m, CLEAN, CORRUPT, metric, method="eap-ig", steps=1, ig="activations")
    assert torch.allclose(act.values, eap.values, atol=1e-12)  # the clean end: EAP
    inp = edge_scores(m, CLEAN, CORRUPT, metric, method="eap-ig", steps=1)
    swapped = edge_scores(m, CORRUPT, CLEAN, metric)  # (clean - corrupted) . gradient at the corrupted run
    assert torch.allclose(inp.values, -swapped.values, atol=1e-12)  # Hanna et al.'s first point: the corrupted end


@pytest.mark.parametrize("ig, end", [("inputs", "input->"), ("activations", "->logits")])
def test_eap_ig_completeness(ig, end):
    """The input's edges (inputs) or the logits' edges (activations) add up to m_corrupted - m_clean as the steps
    grow: the path integral of the metric's gradient along the interpolated line, by the chain rule."""
    m = tiny(kv=2)
    metric = logit_diff(2, 5)
    g = graph(m)
    chosen = torch.tensor([e.startswith(end) if end.endswith(">") else e.endswith(end) for e in g.edges])
    errs = []
    for steps in (2, 8, 32):
        r = edge_scores(m, CLEAN, CORRUPT, metric, method="eap-ig", steps=steps, ig=ig)
        errs.append(abs(float(r.values[chosen].sum()) - (r.corrupted - r.clean)))
    assert errs[2] < errs[1] < errs[0]
    assert errs[2] < 0.1 * errs[0]


def test_scores_round_trip(tmp_path):
    m = tiny(kv=2)
    r = edge_scores(m, CLEAN, CORRUPT, logit_diff(2, 5))
    path = r.save(tmp_path / "scores.json")
    back = type(r).load(path)
    assert back.edges == r.edges and torch.allclose(back.values, r.values)
    assert r.scores[r.top(1)[0][0]] == r.top(1)[0][1]


@pytest.mark.parametrize("kw, match", [({"method": "magic"}, "method"), ({"method": "eap-ig", "steps": 0}, "steps"),
                                       ({"method": "eap-ig", "ig": "both"}, "ig="),
                                       ({"edges": ["input->logits"]}, "edges=")])
def test_bad_arguments(kw, match):
    with pytest.raises(ConfigError, match=match):
        edge_scores(tiny(), CLEAN, CORRUPT, logit_diff(2, 5), **kw)


def test_same_inputs_refused():
    with pytest.raises(HeadlabError, match="same input"):
        edge_scores(tiny(), CLEAN, CLEAN, logit_diff(2, 5))
    with pytest.raises(ConfigError, match="not an edge"):
        edge_patch(tiny(), CLEAN, CORRUPT, logit_diff(2, 5), edges=["logits->input"])
