"""The circuit page (``headlab.interpret.circuits.page``): one ``<line class="edge">`` per edge, from its sender's top
to its receiver's q, k or v port (dashed by kind), coloured by the score's sign and as wide as ``|score|``; the heads'
labels (a dict or an atlas) in their nodes; the faithfulness curve (with its random band and the circuit's own point)
when given, none otherwise; the top-edges table; nothing fetched from the network; the notebook frame and the file.
In a headless Chromium the page checks itself (``#selftest``), skipped with the reason where none is installed."""

from __future__ import annotations

import html
import re

import pytest

from conftest import require_browser
from headlab.interpret.circuits.circuit import Circuit
from headlab.interpret.circuits.faithfulness_result import Faithfulness
from headlab.interpret.circuits.graph import graph
from headlab.interpret.circuits.page import curve_points, head_labels, inline, render, write
from headlab.models.transformer import Transformer, TransformerConfig

EDGES = ["input->a0.h1<q>", "input->a0.h0<k>", "a0.h1->a1.h2<q>", "a0.h1->a1.h1<k>", "a0.h3->a1.h0<v>", "a0.h1->m0",
         "m0->a1.h1<v>", "a1.h2->logits", "m1->logits"]
SCORES = {e: (-1) ** i * (i + 1) / 10 for i, e in enumerate(EDGES)}


def _graph(kv: int):
    return graph(Transformer(TransformerConfig(n_layers=2, n_heads=4, n_kv_heads=kv, causal=True)))


@pytest.fixture(scope="module")
def gqa():
    """A circuit of a grouped-query model (4 heads on 2 kv heads)."""
    return Circuit.of(_graph(2), EDGES, method="top-n", scores=SCORES, ablation="patch", metric="logit_diff",
                      clean=2.0, corrupted=0.0, empty=0.1, circuit_metric=1.5)


@pytest.fixture(scope="module")
def faith():
    return Faithfulness(model="toy", metric="logit_diff", source="eap-ig scores", ablation="patch", n_examples=4,
                        n_graph_edges=82, sizes=[0, 8, 41, 82], fractions=[0.0, 0.1, 0.5, 1.0], kept=[0, 6, 30, 82],
                        values=[0.1, 1.0, 1.8, 2.0], f=[0.0, 0.5, 0.9, 1.0], random=2,
                        random_mean=[0.0, 0.1, 0.4, 1.0], random_sd=[0.0, 0.05, 0.1, 0.0], full=2.0, empty=0.1,
                        clean=2.0, corrupted=0.0, cpr=0.71, cmd=0.29)


def _lines(page: str) -> list[str]:
    return re.findall(r'<line class="edge"[^>]*>', page)


def _attr(tag: str, name: str) -> str | None:
    m = re.search(rf'\b{name}="([^"]*)"', tag)
    return None if m is None else html.unescape(m.group(1))


def test_one_line_per_edge_with_kind_sign_and_width(gqa):
    page = render(gqa)
    lines = _lines(page)
    assert page.count('<svg class="circuit"') == 1 and len(lines) == len(EDGES)
    by_edge = {_attr(t, "data-edge"): t for t in lines}
    assert set(by_edge) == set(EDGES)
    dash = {"q": None, "k": "7 4", "v": "2 3", "mlp": None, "logits": None}
    for e, tag in by_edge.items():
        kind = _attr(tag, "data-kind")
        assert kind == {"q": "q", "k": "k", "v": "v"}.get(e[-2], "logits" if e.endswith("logits") else "mlp"), e
        assert _attr(tag, "stroke-dasharray") == dash[kind], e
        assert _attr(tag, "stroke") == ("#1971c2" if SCORES[e] > 0 else "#e8590c"), e
        assert float(_attr(tag, "y1")) > float(_attr(tag, "y2")), e  # every edge runs up the page
    widths = {e: float(_attr(t, "stroke-width")) for e, t in by_edge.items()}
    strongest = max(EDGES, key=lambda e: abs(SCORES[e]))
    assert widths[strongest] == pytest.approx(5.0) and min(widths.values()) < 1.5
    # q, k and v of one head end at three different ports of its lower edge
    q, v = by_edge["a0.h1->a1.h2<q>"], by_edge["m0->a1.h1<v>"]
    assert _attr(q, "data-to") == "a1.h2" and _attr(v, "data-to") == "a1.kv1"  # GQA: v of kv head 1, its own node


def test_grouped_query_nodes_and_plain_heads():
    """On GQA the k/v edges end on a kv node joined to its query heads; with one kv head per head, on the head."""
    gqa = render(Circuit.of(_graph(2), EDGES, scores=SCORES))
    assert 'data-node="a0.kv0"' in gqa and 'data-node="a1.kv1"' in gqa and 'class="group"' in gqa
    mha = render(Circuit.of(_graph(4), EDGES, scores=SCORES))
    assert "kv" not in "".join(re.findall(r'data-node="[^"]*"', mha))
    tag = next(t for t in _lines(mha) if _attr(t, "data-edge") == "a0.h1->a1.h1<k>")
    assert _attr(tag, "data-to") == "a1.h1"
    x_k = next(float(_attr(t, "x2")) for t in _lines(mha) if _attr(t, "data-edge") == "a0.h1->a1.h1<k>")
    x_v = next(float(_attr(t, "x2")) for t in _lines(mha) if _attr(t, "data-edge") == "m0->a1.h1<v>")
    assert x_v - x_k == pytest.approx(16)  # k's port at the head's centre, v's to its right (q's to its left)


def test_labels_appear_in_the_nodes_and_the_table(gqa):
    page = render(gqa, labels={"a1.h2": "induction", "0.1": ["previous-token", "copying"], (0, 3): "sink"})
    svg = page[page.index('<svg class="circuit"'):page.index("</svg>")]
    assert "induction" in svg and "previous-t" in svg and "sink" in svg
    assert "a0.h1: previous-token, copying" in page  # the full text in the node's title and the table
    assert "labelled heads in the circuit" in page
    assert head_labels({"3.2": ["induction"], "a0.h1": ""}) == {"a3.h2": "induction"}


def test_atlas_labels(gqa):
    class Atlas:  # what the page reads of headlab.interpret.atlas.Atlas
        n_layers, n_heads = 2, 4

        def roles(self, layer, head):
            return ["induction head"] if (layer, head) == (1, 2) else []

    assert head_labels(Atlas()) == {"a1.h2": "induction head"}
    assert "induction head" in render(gqa, labels=Atlas())


def test_the_faithfulness_curve_only_when_given(gqa, faith):
    assert '<svg class="faithfulness"' not in render(gqa) and "CPR" not in render(gqa)
    page = render(gqa, faith)
    assert page.count('<svg class="faithfulness"') == 1
    assert page.count('<circle class="point"') == 3  # fraction 0 has no place on a log axis
    assert 'class="random-band"' in page and 'class="random-mean"' in page
    assert 'class="own"' in page  # the page's circuit: f = (1.5 - 0.1) / (2.0 - 0.1)
    assert "CPR 0.71" in page and "CMD 0.29" in page
    same = render(gqa, faith.to_result().to_json())  # the JSON file's dict draws the same curve
    assert re.findall(r'<svg class="faithfulness".*?</svg>', same, re.S) == \
        re.findall(r'<svg class="faithfulness".*?</svg>', page, re.S)
    pts = curve_points(faith)
    assert pts["random_lo"][1] == pytest.approx(0.05) and pts["random_hi"][2] == pytest.approx(0.5)


def test_top_edges_table(gqa):
    page = render(gqa, top=3)
    rows = re.findall(r'<tr data-edge="([^"]*)"', page)
    assert [html.unescape(r) for r in rows] == ["m1->logits", "a1.h2->logits", "m0->a1.h1<v>"]
    assert f"{len(EDGES) - 3} more edges" in page


def test_offline_inline_and_file(gqa, faith, tmp_path):
    page = render(gqa, faith, labels={"a1.h2": "induction"})
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?://|//cdn|<link\b|<script[^>]*\bsrc=|<img[^>]*\bsrc=\"(?!data:)", page)
    assert inline(gqa).startswith('<iframe class="headlab-page" sandbox="allow-scripts"')
    path = write(tmp_path / "c.html", gqa, faith, labels={"a1.h2": "induction"})
    assert path.read_text(encoding="utf-8") == page


def test_an_empty_circuit_still_renders():
    page = render(Circuit.of(_graph(2), [], scores={}))
    assert len(_lines(page)) == 0 and "the circuit has no edges" in page


def test_page_checks_itself_in_a_browser(gqa, faith, tmp_path):
    from test_browser import open_page, selftest_result

    browser = require_browser()
    dom, console = open_page(browser, render(gqa, faith, labels={"a1.h2": "induction"}), tmp_path, "circuit.html")
    status, detail = selftest_result(dom)
    assert status == "pass", detail
    assert 'class="selftest-error"' not in dom and console == []
