"""Circuits: pruning and nodes, discovery (top-n, greedy, ACDC) and faithfulness (f, CPR, CMD), each checked
against a computation of its own here: paths by enumerating them, top-n by sorting, f from plain forwards and
from patched_metric, CPR/CMD by numpy's trapezoid, ACDC by a loop written from Conmy et al.'s description."""

from __future__ import annotations

import math
import random as pyrandom
from collections import defaultdict

import numpy as np
import pytest
import torch

from headlab.errors import ConfigError, InputError, ShapeError
from headlab.interpret.circuits import discovery as discover_mod
from headlab.interpret.circuits import eap as eap_mod
from headlab.interpret.circuits import evaluation as faith_mod
from headlab.interpret.circuits import nodes as nodes_mod
from headlab.interpret.circuits.circuit import Circuit, on_paths
from headlab.interpret.circuits.discovery import discover
from headlab.interpret.circuits.eap import edge_scores
from headlab.interpret.circuits.evaluation import MIB_FRACTIONS, faithfulness, mib_areas
from headlab.interpret.circuits.faithfulness_result import Faithfulness
from headlab.interpret.circuits.graph import graph
from headlab.interpret.circuits.patching import ablated_outputs, patched_metric
from headlab.interpret.patching import logit_diff, runs
from headlab.models.transformer import Transformer, TransformerConfig

CLEAN = torch.tensor([[1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8]])
CORRUPT = torch.tensor([[1, 9, 3, 4, 5, 6], [3, 11, 5, 6, 7, 8]])
METRIC = logit_diff(2, 5)


def tiny(n_layers: int = 3, seed: int = 0, heads: int = 4, kv_heads: int = 2) -> Transformer:
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=20, d_model=16, n_layers=n_layers, n_heads=heads, n_kv_heads=kv_heads,
                            causal=True)
    return Transformer(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def model3():
    return tiny(3)


@pytest.fixture(scope="module")
def scores3(model3):
    return edge_scores(model3, CLEAN, CORRUPT, METRIC, method="eap")


# ---- an independent account of paths: enumerate them -----------------------------------------------------

def _targets(receiver: str, heads: int = 4, kv_heads: int = 2) -> list[str]:
    """The nodes a receiver feeds, written from the GQA layout: query head h reads kv head h * Hkv // H."""
    if receiver == "logits" or receiver.startswith("m"):
        return [receiver]
    node, kind = receiver[:-3], receiver[-2]
    layer, idx = node[1:].split(".h")
    if kind == "q":
        return [node]
    return [f"a{layer}.h{h}" for h in range(heads) if h * kv_heads // heads == int(idx)]


def brute_on_paths(edges: list[str]) -> tuple[set[str], set[str]]:
    """(edges on some input -> logits path, nodes on one), by walking every path."""
    succ = defaultdict(list)
    for e in edges:
        s, r = e.split("->")
        for t in _targets(r):
            succ[s].append((t, e))
    on_edges, on_nodes = set(), set()

    def walk(node, path_edges, path_nodes):
        if node == "logits":
            on_edges.update(path_edges)
            on_nodes.update(path_nodes + ["logits"])
            return
        for t, e in succ[node]:
            walk(t, path_edges + [e], path_nodes + [node])

    walk("input", [], [])
    return on_edges, on_nodes


def test_prune_and_nodes_on_a_hand_built_circuit():
    g = graph(tiny(2))
    edges = ["input->a0.h0<q>", "a0.h0->a1.h0<v>",  # kv group 0 of layer 1 feeds a1.h0 and a1.h1
             "a1.h1->logits",  # ... and a1.h1 reaches the logits, so the v edge is on a path through a1.h1
             "a0.h2->m0", "m0->m1",  # a0.h2 has no input edge: never reached from the input
             "input->a1.h3<q>",  # a1.h3 never reaches the logits
             "input->m1", "m1->logits"]
    c = Circuit.of(g, edges)
    pruned = c.prune()
    assert pruned.edges == ["input->a0.h0<q>", "a0.h0->a1.h0<v>", "input->m1", "a1.h1->logits", "m1->logits"]
    assert c.nodes == ["input", "a0.h0", "a1.h1", "m1", "logits"]  # a1.h0 is fed but reaches nothing
    assert pruned.nodes == c.nodes
    assert any("pruned 3 of 8" in n for n in pruned.notes)
    assert pruned.prune().edges == pruned.edges  # pruning twice changes nothing
    assert (set(pruned.edges), set(pruned.nodes)) == brute_on_paths(edges)
    assert Circuit.of(g, ["a0.h2->m0"]).nodes == []


def test_prune_matches_path_enumeration_on_random_circuits():
    g = graph(tiny(2))
    rng = pyrandom.Random(0)
    for trial in range(60):
        edges = rng.sample(g.edges, rng.choice([3, 8, 15, 25]))
        want_edges, want_nodes = brute_on_paths(edges)
        mask = Circuit.of(g, edges).mask(g)
        got = on_paths(g, mask)
        assert {g.edges[i] for i in got.nonzero().flatten().tolist()} == want_edges, edges
        assert set(Circuit.of(g, edges).nodes) == want_nodes


# ---- discovery ---------------------------------------------------------------------------------------------

def test_top_n_signed_takes_the_edges_moving_the_metric_furthest_towards_corrupted(model3, scores3):
    n = 12
    sign = 1.0 if scores3.corrupted >= scores3.clean else -1.0
    want = {e for e, _ in sorted(scores3.scores.items(), key=lambda t: -sign * t[1])[:n]}
    raw = discover(model3, CLEAN, CORRUPT, METRIC, n_edges=n, scores=scores3, prune=False, absolute=False)
    assert set(raw.edges) == want and raw.settings["absolute"] is False
    assert all(sign * scores3.scores[e] >= min(sign * scores3.scores[x] for x in want) for e in raw.edges)
    with pytest.raises(ConfigError, match="absolute"):
        discover(model3, CLEAN, CORRUPT, METRIC, n_edges=n, scores=scores3, absolute="no")


def test_top_n_takes_the_n_largest_abs_scores_then_prunes(model3, scores3):
    n = 12
    want = {e for e, _ in sorted(scores3.scores.items(), key=lambda t: -abs(t[1]))[:n]}
    raw = discover(model3, CLEAN, CORRUPT, METRIC, n_edges=n, scores=scores3, prune=False)
    assert set(raw.edges) == want and raw.n_edges == n and raw.method == "top-n"
    assert raw.scores == {e: scores3.scores[e] for e in want}
    pruned = discover(model3, CLEAN, CORRUPT, METRIC, n_edges=n, scores=scores3)
    assert set(pruned.edges) == brute_on_paths(sorted(want))[0]
    assert pruned.settings["chosen"] == n
    # the circuit's metric: every edge outside it reads the corrupted sender output
    pair = runs.prepare(model3, CLEAN, CORRUPT)
    g = graph(model3)
    with torch.no_grad():
        ko, _ = nodes_mod.record(pair, g, pair.corrupted)
        m_c = float(patched_metric(pair, g, METRIC, ~pruned.mask(g), ko).mean())
    assert pruned.circuit_metric == pytest.approx(m_c, abs=1e-6)
    assert pruned.clean == pytest.approx(float(METRIC(model3(CLEAN).logits).mean()), abs=1e-5)
    assert pruned.empty == pytest.approx(float(METRIC(model3(CORRUPT).logits).mean()), abs=1e-4)


def test_greedy_grows_from_the_logits(model3, scores3):
    n = 15
    raw = discover(model3, CLEAN, CORRUPT, METRIC, method="greedy", n_edges=n, scores=scores3, prune=False)
    assert raw.n_edges == n
    into_logits = [(e, v) for e, v in scores3.scores.items() if e.endswith("->logits")]
    assert max(into_logits, key=lambda t: abs(t[1]))[0] in raw.edges  # the first pick
    # every chosen edge's receiver feeds a node that reaches the logits through chosen edges
    reaches = {"logits"}
    changed = True
    while changed:
        changed = False
        for e in raw.edges:
            s, r = e.split("->")
            if s not in reaches and any(t in reaches for t in _targets(r)):
                reaches.add(s)
                changed = True
    assert all(any(t in reaches for t in _targets(e.split("->")[1])) for e in raw.edges)
    pruned = discover(model3, CLEAN, CORRUPT, METRIC, method="greedy", n_edges=n, scores=scores3)
    assert set(pruned.edges) == brute_on_paths(raw.edges)[0] and pruned.nodes[-1] == "logits"


def _dead_head_model():
    """2 layers of 2 heads sharing one kv head (36 edges); head a1.h0 writes nothing (its W_O columns are zero), so
    edges out of it and into its q change nothing (its k and v inputs are shared with a1.h1)."""
    m = tiny(2, seed=1, heads=2, kv_heads=1)
    d = m.config.d_model // m.config.n_heads
    with torch.no_grad():
        m.blocks[1].attn.out_proj.weight[:, 0:d] = 0.0
    return m


def test_acdc_threshold_zero_keeps_every_edge_that_changes_the_metric():
    m = _dead_head_model()
    c = discover(m, CLEAN, CORRUPT, METRIC, method="acdc", threshold=0.0, criterion="metric", prune=False)
    assert not [e for e in c.edges if e.startswith("a1.h0->") or e.endswith("a1.h0<q>")]
    assert c.circuit_metric == pytest.approx(c.clean, abs=1e-6)  # only changes of exactly 0 were removed
    pair = runs.prepare(m, CLEAN, CORRUPT)
    g = graph(m)
    with torch.no_grad():
        ko, _ = nodes_mod.record(pair, g, pair.corrupted)
    keep = c.mask(g)
    base = float(patched_metric(pair, g, METRIC, ~keep, ko).mean())
    for i in keep.nonzero().flatten().tolist():  # each kept edge, removed now, still moves the metric
        keep[i] = False
        assert float(patched_metric(pair, g, METRIC, ~keep, ko).mean()) != base, g.edges[i]
        keep[i] = True
    removed = [e for e, v in c.scores.items() if e not in c.edges]
    assert removed and all(c.scores[e] == 0.0 for e in removed)


def test_acdc_matches_a_loop_written_from_the_paper():
    m = tiny(2, seed=2, heads=2, kv_heads=1)
    pair = runs.prepare(m, CLEAN, CORRUPT)
    g = graph(m)
    with torch.no_grad():
        ko, _ = nodes_mod.record(pair, g, pair.corrupted)
        ref = torch.log_softmax(m(CLEAN).logits[:, -1].double(), -1)

    def kl(keep):
        def metric(logits):
            lp = torch.log_softmax(logits[:, -1].double(), -1)
            return (ref.exp() * (ref - lp)).sum(-1)
        return float(patched_metric(pair, g, metric, ~keep, ko).mean())

    threshold = kl(torch.zeros(g.n_edges, dtype=torch.bool)) / 40  # KL of the empty circuit: about 1e-5 here
    c = discover(m, CLEAN, CORRUPT, METRIC, method="acdc", threshold=threshold)  # KL criterion, pruned
    # receivers from the logits backwards, senders latest first; remove when KL grows by <= threshold
    keep = torch.ones(g.n_edges, dtype=torch.bool)
    current = kl(keep)
    order = sorted(range(g.n_edges), key=lambda i: (g.receivers.index(g.parse(g.edges[i])[1]),
                                                    g.parse(g.edges[i])[0]), reverse=True)
    for i in order:
        keep[i] = False
        new = kl(keep)
        if new - current <= threshold:
            current = new
        else:
            keep[i] = True
    want = {g.edges[i] for i in on_paths(g, keep).nonzero().flatten().tolist()}
    assert 0 < len(c.edges) < g.n_edges
    assert set(c.edges) == want


# ---- faithfulness ------------------------------------------------------------------------------------------

def test_faithfulness_endpoints_and_a_middle_point(model3, scores3):
    g = graph(model3)
    N = g.n_edges
    r = faithfulness(model3, scores3, CLEAN, CORRUPT, METRIC, sizes=[0, 20, N], random=2)
    assert r.f[0] == 0.0 and r.f[-1] == 1.0  # exactly
    assert r.kept[0] == 0 and r.kept[-1] == N
    assert r.full == pytest.approx(float(METRIC(model3(CLEAN).logits).mean()), abs=1e-5)
    assert r.empty == pytest.approx(float(METRIC(model3(CORRUPT).logits).mean()), abs=1e-4)
    top = [e for e, _ in sorted(scores3.scores.items(), key=lambda t: -abs(t[1]))[:20]]
    circuit = brute_on_paths(top)[0]
    pair = runs.prepare(model3, CLEAN, CORRUPT)
    with torch.no_grad():
        ko, _ = nodes_mod.record(pair, g, pair.corrupted)
        m_c = float(patched_metric(pair, g, METRIC, ~Circuit.of(g, sorted(circuit)).mask(g), ko).mean())
    assert r.kept[1] == len(circuit)
    assert r.values[1] == pytest.approx(m_c, abs=1e-6)
    assert r.f[1] == pytest.approx((m_c - r.empty) / (r.full - r.empty), abs=1e-6)
    assert r.random_sd[0] == 0.0 and r.random_mean[-1] == 1.0  # every random circuit of all edges is the model
    # a circuit object: one point, the same value
    one = faithfulness(model3, Circuit.of(g, sorted(circuit)), CLEAN, CORRUPT, METRIC, random=0)
    assert one.sizes == [len(circuit)] and one.f[0] == pytest.approx(r.f[1], abs=1e-9) and one.cpr is None


def test_mib_areas_are_trapezoids_on_the_fractions(model3, scores3):
    x = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
    f = [0.0, 0.1, -0.2, 0.3, 0.5, 0.6, 0.8, 0.9, 1.3, 1.0]
    cpr, cmd = mib_areas(x, f)
    by_hand_cpr = sum((x[i + 1] - x[i]) * (f[i] + f[i + 1]) / 2 for i in range(9))
    assert cpr == pytest.approx(by_hand_cpr, abs=1e-15)
    assert cpr == pytest.approx(np.trapezoid(f, x) if hasattr(np, "trapezoid") else np.trapz(f, x), abs=1e-12)
    g1 = [abs(1 - v) for v in f]
    assert cmd == pytest.approx(np.trapezoid(g1, x) if hasattr(np, "trapezoid") else np.trapz(g1, x), abs=1e-12)
    assert mib_areas([0.0, 0.5, 1.0], [0.0, 1.0, 1.0]) == (0.75, 0.25)  # 0.25 + 0.5; 0.25 + 0
    # the default sizes: MIB's fractions, k = int(fraction * n_edges), areas on the fractions
    r = faithfulness(model3, scores3, CLEAN, CORRUPT, METRIC, random=0)
    N = r.n_graph_edges
    assert r.fractions == list(MIB_FRACTIONS) and r.sizes == [int(p * N) for p in MIB_FRACTIONS]
    assert (r.cpr, r.cmd) == pytest.approx(mib_areas(list(MIB_FRACTIONS), r.f), abs=1e-15)
    assert r.f[-1] == 1.0 and "CPR" in r.table() and "CMD" in r.table()


def test_spread_over_templates_and_resample_seeds(model3, scores3):
    clean = torch.cat([CLEAN, CLEAN.flip(1)])
    corrupt = torch.cat([CORRUPT, CORRUPT.flip(1)])
    s = edge_scores(model3, clean, corrupt, METRIC, method="eap")
    g = graph(model3)
    templates = ["fwd", "fwd", "rev", "rev"]
    r = faithfulness(model3, s, clean, corrupt, METRIC, sizes=[0, 30, g.n_edges], random=0, templates=templates)
    assert list(r.by_template) == ["fwd", "rev"]
    assert r.by_template["fwd"][0] == 0.0 and r.by_template["rev"][-1] == 1.0
    pair = runs.prepare(model3, clean, corrupt)
    with torch.no_grad():
        co, _ = nodes_mod.record(pair, g, pair.clean)
        ko, _ = nodes_mod.record(pair, g, pair.corrupted)
    top = torch.zeros(g.n_edges, dtype=torch.bool)
    top[torch.sort(-s.values.abs(), stable=True).indices[:30]] = True
    mask = on_paths(g, top)
    none = torch.zeros_like(mask)
    vc, ve, vf = (patched_metric(pair, g, METRIC, p, ko).double() for p in (~mask, ~none, none))
    idx = torch.tensor([2, 3])
    want = float((vc[idx].mean() - ve[idx].mean()) / (vf[idx].mean() - ve[idx].mean()))
    assert r.by_template["rev"][1] == pytest.approx(want, abs=1e-6)
    # resample seeds: each pairing its own empty circuit; the full circuit is 1 under every one
    rs = faithfulness(model3, s, clean, corrupt, METRIC, sizes=[0, 30, g.n_edges], random=0, ablation="resample",
                      seeds=3, seed=4)
    assert rs.seeds == [4, 5, 6] and rs.seed_sd[0] == 0.0 and rs.seed_sd[-1] == 0.0 and rs.f[-1] == 1.0
    fs = []
    for sd in (4, 5, 6):
        ab = ablated_outputs(co, ko, "resample", seed=sd)
        c_, e_ = (float(patched_metric(pair, g, METRIC, p, ab).double().mean()) for p in (~mask, ~none))
        fs.append((c_ - e_) / (float(vf.mean()) - e_))
    assert rs.f[1] == pytest.approx(sum(fs) / 3, abs=1e-6)
    assert rs.seed_sd[1] == pytest.approx(float(np.std(fs, ddof=1)), abs=1e-6)


def test_save_and_load_round_trip(tmp_path, model3, scores3):
    c = discover(model3, CLEAN, CORRUPT, METRIC, n_edges=10, scores=scores3)
    back = Circuit.load(c.save(tmp_path / "circuit.json"))
    assert back.to_result().to_json() == c.to_result().to_json()
    assert back.edges == c.edges and back.nodes == c.nodes and back.mask(graph(model3)).equal(c.mask())
    page = c._repr_html_()  # the circuit page in a sandboxed frame
    assert page.startswith("<iframe") and "&lt;svg" in page and c.edges[0].split("->")[0] in page
    r = faithfulness(model3, scores3, CLEAN, CORRUPT, METRIC, sizes=[0, 10, 190], random=1, templates=["a", "b"])
    rb = Faithfulness.load(r.save(tmp_path / "faith.json"))
    assert rb.to_result().to_json() == r.to_result().to_json() and rb.table() == r.table()
    with pytest.raises(InputError, match="not a circuit"):
        Circuit.load(tmp_path / "faith.json")
    with pytest.raises(InputError, match="not circuit faithfulness"):
        Faithfulness.load(tmp_path / "circuit.json")


# ---- typed errors before any forward -----------------------------------------------------------------------

@pytest.fixture
def no_forward(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a forward ran before the arguments were checked")

    monkeypatch.setattr(discover_mod, "patched_metric", boom)
    monkeypatch.setattr(faith_mod, "patched_metric", boom)
    monkeypatch.setattr(nodes_mod, "record", boom)
    monkeypatch.setattr(eap_mod, "edge_scores", boom)


BAD_DISCOVER = [
    ({"method": "magic", "n_edges": 3}, ConfigError, "method="),
    ({"n_edges": None}, ConfigError, "n_edges=None"),
    ({"n_edges": 0}, ConfigError, "n_edges=0"),
    ({"n_edges": True}, ConfigError, "n_edges=True"),
    ({"n_edges": 10 ** 6}, ConfigError, "this graph has 190 edges"),
    ({"n_edges": 3, "threshold": 0.1}, ConfigError, "threshold is ACDC's"),
    ({"n_edges": 3, "criterion": "metric"}, ConfigError, "criterion is ACDC's"),
    ({"n_edges": 3, "ablation": "blur"}, ConfigError, "ablation="),
    ({"n_edges": 3, "score_method": "lrp"}, ConfigError, "score_method="),
    ({"n_edges": 3, "steps": 0, "score_method": "eap-ig"}, ConfigError, "steps=0"),
    ({"n_edges": 3, "scores": {"a": 1.0}}, ConfigError, "scores must be EdgeScores"),
    ({"n_edges": 3, "progress": "yes"}, ConfigError, "progress"),
    ({"n_edges": 3, "seed": -1}, ConfigError, "seed=-1"),
    ({"method": "acdc"}, ConfigError, "threshold=None"),
    ({"method": "acdc", "threshold": -0.1}, ConfigError, "threshold=-0.1"),
    ({"method": "acdc", "threshold": float("nan")}, ConfigError, "threshold=nan"),
    ({"method": "acdc", "threshold": 0.1, "n_edges": 5}, ConfigError, "n_edges is top-n's"),
    ({"method": "acdc", "threshold": 0.1, "criterion": "l2"}, ConfigError, "criterion="),
    ({"method": "acdc", "threshold": 0.1, "acdc_max_edges": 100}, ConfigError, "one forward per edge"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_DISCOVER, ids=[str(i) for i in range(len(BAD_DISCOVER))])
def test_discover_refuses_bad_arguments_before_any_forward(no_forward, model3, kwargs, error, match):
    with pytest.raises(error, match=match.replace("(", r"\(")):
        discover(model3, CLEAN, CORRUPT, METRIC, **kwargs)


def test_more_refusals_before_any_forward(no_forward, model3, scores3):
    small = Circuit.of(graph(tiny(2)), ["input->a0.h0<q>"])
    with pytest.raises(ConfigError, match="EdgeScores"):
        faithfulness(model3, [1, 2], CLEAN, CORRUPT, METRIC)
    with pytest.raises(ConfigError, match="increasing"):
        faithfulness(model3, scores3, CLEAN, CORRUPT, METRIC, sizes=[5, 5])
    with pytest.raises(ConfigError, match="this graph has 190"):
        faithfulness(model3, scores3, CLEAN, CORRUPT, METRIC, sizes=[5, 500])
    with pytest.raises(ConfigError, match="sizes ranks"):
        faithfulness(model3, small, CLEAN, CORRUPT, METRIC, sizes=[1])
    with pytest.raises(ConfigError, match="only ablation='resample'"):
        faithfulness(model3, scores3, CLEAN, CORRUPT, METRIC, seeds=2)
    with pytest.raises(ConfigError, match="random="):
        faithfulness(model3, scores3, CLEAN, CORRUPT, METRIC, random=-1)
    with pytest.raises(ShapeError, match="templates has 3"):
        faithfulness(model3, scores3, CLEAN, CORRUPT, METRIC, templates=["a", "b", "c"])
    with pytest.raises(InputError, match="heads"):  # a circuit of another model
        faithfulness(model3, small, CLEAN, CORRUPT, METRIC)
    two_layer_scores = scores3.__class__(**{**scores3.__dict__, "edges": scores3.edges[:50],
                                            "values": scores3.values[:50]})
    with pytest.raises(InputError, match="graph of 50 edges"):
        discover(model3, CLEAN, CORRUPT, METRIC, n_edges=3, scores=two_layer_scores)
    nan = scores3.values.clone()
    nan[4] = math.nan
    with pytest.raises(InputError, match="NaN"):
        faithfulness(model3, scores3.__class__(**{**scores3.__dict__, "values": nan}), CLEAN, CORRUPT, METRIC)
    with pytest.raises(ConfigError, match="not an edge name"):
        Circuit(model="x", edges=["a0.h1=>m1"], heads=[4], kv_heads=[2], parallel=[False], n_graph_edges=1)
    with pytest.raises(ConfigError, match="not an edge of this graph"):
        Circuit.of(graph(model3), ["m2->a1.h0<q>"])
    with pytest.raises(ConfigError, match="listed twice"):
        Circuit(model="x", edges=["m0->m1", "m0->m1"], heads=[4], kv_heads=[2], parallel=[False], n_graph_edges=1)
