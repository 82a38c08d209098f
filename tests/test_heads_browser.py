"""The ``headlab heads`` page in a real headless Chromium: every heatmap paints one coloured cell per head,
the interaction matrix is k x k, a click selects the head's verdict row, and the console stays silent.
Skipped, with the reason, when no Chromium is installed, failed under CI (as tests/test_browser.py)."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from conftest import require_browser
from headlab.interpret.heads.ablation import ablate
from headlab.interpret.heads.importance import importance_study
from headlab.interpret.heads.page import head_annotations, render_page
from headlab.interpret.heads.prune import pruning_curve
from headlab.models.transformer import Transformer, TransformerConfig

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser():
    return require_browser()


@pytest.fixture(scope="module")
def results():
    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=30, d_model=16, n_layers=2, n_heads=4, causal=True)).eval()
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, 30, (6,), generator=g) for _ in range(6)]
    ab = ablate(m, texts, loss="lm", k=4, n_boot=50)
    imp = importance_study(m, texts, loss="lm", single_effects=ab.single)
    return imp, ab, pruning_curve(m, texts, loss="lm", step=0.25, max_fraction=0.75)


def _open(browser, page, tmp_path):
    path = tmp_path / "heads.html"
    path.write_text(page, encoding="utf-8")
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--disable-extensions", "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}",
           "--virtual-time-budget=3000", "--dump-dom", f"{path.as_uri()}#selftest"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return proc.stdout, [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]


def test_heads_page_selftest(browser, results, tmp_path):
    imp, ab, curve = results
    page = render_page(title="heads test", importance=imp, ablation=ab, curve=curve)
    dom, console = _open(browser, page, tmp_path)
    m = re.search(r'<pre id="selftest-result" data-status="(\w+)"[^>]*>(.*?)</pre>', dom, re.S)
    assert m is not None, dom[-1500:]
    assert m.group(1) == "pass", m.group(2)
    assert 'data-checked-grids="5"' in dom and console == [] and 'class="selftest-error"' not in dom


def test_a_broken_heads_page_is_caught(browser, results, tmp_path):
    imp, ab, _ = results
    page = render_page(title="heads test", importance=imp, ablation=ab).replace('data-l="0" data-h="0" ', "", 1)
    dom, _ = _open(browser, page, tmp_path)
    assert 'data-status="fail"' in dom


def test_head_annotations_from_results_and_files(results, tmp_path):
    import json

    imp, ab, _ = results
    ann = head_annotations(ab)
    assert len(ann) == 8 and all(isinstance(k, tuple) for k in ann)
    v = ab.verdict_of(1, 2)
    assert v.label() in ann[(1, 2)]
    path = tmp_path / "importance.json"
    path.write_text(json.dumps(imp.to_json()))
    assert "rank" in head_annotations(path)[(0, 0)]
