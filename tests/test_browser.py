"""The report page in a real headless Chromium: it draws a heatmap, reacts to a hover, logs nothing.

The page checks itself when opened with ``#selftest`` (see :mod:`headlab.interpret.report.html`):
every drawn head paints its heatmap (a pixel of its largest weight has that weight's colour) and, when the
page carries them, its norm map and the rollout view; a
synthetic hover on a token colours both token strips with the right row and column and outlines
the row on the heatmap, and a hover on the heatmap moves the focus. The result and any script
error are written into the DOM, which ``chromium --dump-dom`` returns; Chromium's own console log
(``--enable-logging=stderr``) must show no message at all. Skipped, with the reason, when no
Chromium is installed; failed under CI (``CI=true``), where ``.ci/run`` installs Debian's ``chromium``
(see :func:`conftest.require`).
"""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest

from conftest import require_browser
from headlab.interpret.heads.labels import head_records, row_stats_from_maps
from headlab.interpret.report.html import encode_map, render_html

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser():
    return require_browser()


def open_page(browser: str, page: str, tmp_path, name: str = "report.html") -> tuple[str, list[str]]:
    """Load ``page#selftest`` headless; return (the DOM after scripts ran, console lines)."""
    path = tmp_path / name
    path.write_text(page, encoding="utf-8")
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
           "--disable-extensions", "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}",
           "--window-size=1400,1200", "--virtual-time-budget=3000", "--dump-dom", f"{path.as_uri()}#selftest"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]
    return proc.stdout, console


def selftest_result(dom: str) -> tuple[str | None, str]:
    m = re.search(r'<pre id="selftest-result" data-status="(\w+)"[^>]*>(.*?)</pre>', dom, re.S)
    return (m.group(1), m.group(2)) if m else (None, "")


def _page(n_layers=2, n_heads=3, drawn=None, tokens=("[CLS]", "the", "cat", "sat", "on", "<mat>", "[SEP]"),
          flow=None):
    rng = np.random.default_rng(0)
    n = len(tokens)
    layers = []
    for _ in range(n_layers):
        S = rng.normal(size=(n_heads, n, n)) * 2
        S[0] += 8 * np.eye(n, k=-1)  # head 0 is a previous-token head
        P = np.exp(S - S.max(-1, keepdims=True))
        layers.append(P / P.sum(-1, keepdims=True))  # (H, n, n)
    recs = head_records([row_stats_from_maps(P, sink_positions=[0, n - 1]) for P in layers], list(tokens),
                        separator_positions=[n - 1])
    drawn = drawn or [(i, h) for i in range(n_layers) for h in range(n_heads)]
    data = None
    if flow is not None:  # norm maps (value norms per drawn head) and a rollout map ("map") or two rows ("rows")
        R = np.eye(n)
        for P in layers:
            A = 0.5 * P.mean(0) + 0.5 * np.eye(n)
            R = A @ R
        roll = {"layer": n_layers - 1, "note": "test rollout", "rows": {"0": R[0].tolist(), str(n - 1): R[-1].tolist()}}
        if flow == "map":
            roll["map"] = encode_map(R)
        data = {"value_norms": {f"{l}.{h}": rng.uniform(0.1, 3.0, n).tolist() for l, h in drawn}, "rollout": roll}
    return render_html(title="browser test", tokens=list(tokens), records=recs,
                       maps={d: layers[d[0]][d[1]] for d in drawn}, n_layers=n_layers, n_heads=n_heads,
                       undrawn_note="statistics only", flow=data)


def test_page_draws_and_reacts_to_hover(browser, tmp_path):
    dom, console = open_page(browser, _page(), tmp_path)
    status, detail = selftest_result(dom)
    assert status == "pass", detail or dom[-2000:]
    assert 'data-checked-heads="6"' in dom
    assert 'class="selftest-error"' not in dom and console == []
    assert re.search(r'<body[^>]*data-focus-token="6"', dom)  # the last hover (on the heatmap) moved the focus


def test_page_with_undrawn_heads(browser, tmp_path):
    # the long-input page: only chosen heads carry maps; the others show their statistics and a note
    dom, console = open_page(browser, _page(drawn=[(1, 0), (0, 2)]), tmp_path)
    status, detail = selftest_result(dom)
    assert status == "pass", detail
    assert 'data-checked-heads="2"' in dom and console == []


@pytest.mark.parametrize("rollout", ["map", "rows"])
def test_page_with_norm_maps_and_rollout(browser, tmp_path, rollout):
    # every drawn head's norm map paints (its largest row share has that share's colour, rows sum to 1); the
    # rollout map paints and the hovered token's row reaches its strip, or the rows given are shown
    drawn = None if rollout == "map" else [(1, 0), (0, 2)]
    dom, console = open_page(browser, _page(drawn=drawn, flow=rollout), tmp_path)
    status, detail = selftest_result(dom)
    assert status == "pass", detail or dom[-2000:]
    k = 6 if rollout == "map" else 2
    assert f'data-checked-heads="{k}" data-checked-norms="{k}"' in dom and console == []
    assert f'data-rollout="{"map" if rollout == "map" else "rows-2"}"' in dom


def test_a_broken_page_is_caught(browser, tmp_path):
    # the harness must fail when the page breaks: a script error after load shows in the DOM and console
    page = _page().replace("</body>", "<script>window.setTimeout(function () { missingFunction(); }, 0);</script></body>")
    dom, console = open_page(browser, page, tmp_path)
    assert 'class="selftest-error"' in dom and "missingFunction" in dom
    assert any("missingFunction" in ln for ln in console)


def test_analyze_report_with_the_saliency_strip(browser, tmp_path):
    # a classifier's report carries the saliency strip (one panel per method, shaded tokens, the agreement
    # table); the page still checks itself and logs nothing
    import torch
    import transformers

    from headlab.interpret.report.analyze_job import analyze
    from headlab.models.named_models import minilm_dir
    from headlab.models.loader import LoadedModel, adapt

    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, num_labels=2)
    model = transformers.BertForSequenceClassification(cfg).eval()
    adapter = adapt(model)
    r = analyze("a gripping , funny film", model=LoadedModel(model, tok, adapter, "tiny-clf", adapter.family, 64),
                out_dir=tmp_path / "rep")
    page = r.html.read_text(encoding="utf-8")
    panels = page.count('class="panel"')
    assert panels >= 5 and 'id="saliency-section"' in page  # attention, gradient, grad x input, IG, LOO, ...
    dom, console = open_page(browser, page, tmp_path)
    status, detail = selftest_result(dom)
    assert status == "pass", detail or dom[-2000:]
    assert console == [] and 'class="selftest-error"' not in dom
    shaded = re.findall(r'<span class="tok" data-i="\d+" style="background:rgba\(', dom.split('id="saliency-section"')[1])
    assert len(shaded) == panels * 5  # the five non-special tokens of "a gripping , funny film" in every panel
