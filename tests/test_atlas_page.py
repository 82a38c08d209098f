"""The atlas page in a real headless Chromium: the role grid and every score heatmap paint one coloured cell per
head, a click fills the focus line with every score, one row per verdict, and the console stays silent; plus the
page's content without a browser (roles in the cells, the GQA groups, the notebook frame). Browser tests are
skipped, with the reason, when no Chromium is installed, failed under CI (as tests/test_browser.py)."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from conftest import require_browser
from headlab.interpret.atlas import atlas
from headlab.interpret.atlas.page import render_page
from headlab.models.transformer import Transformer, TransformerConfig
from test_browser import open_page, selftest_result


@pytest.fixture(scope="module")
def result():
    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, causal=True))
    texts = [[(5 * i) % 37 + 1 for i in range(120)]]
    return atlas(m.eval(), texts=texts, k=2, half=6, n_repeated=3, max_tokens=24, n_texts=3, needle_trials=2,
                 haystack_tokens=30, n_boot=100)


def test_page_content(result):
    page = render_page(result)
    assert page.count('<table class="hm" data-grid="roles">') == 1 and page.count('<tr data-kind=') == len(result.verdicts)
    assert "kv0" in page and "kv1" in page  # the GQA groups under the head numbers
    assert result._repr_html_().startswith('<iframe class="headlab-page"')
    # a head above the induction threshold carries its letter in the role grid
    planted = copy.deepcopy(result)
    planted.scores["induction"][1, 2] = 0.99
    assert 'data-l="1" data-h="2" title="1.2: induction' in render_page(planted)


@pytest.mark.browser
def test_page_in_chromium(result, tmp_path):
    browser = require_browser()
    dom, console = open_page(browser, render_page(result), tmp_path, "atlas.html")
    status, detail = selftest_result(dom)
    assert status == "pass", detail or dom[-2000:]
    assert f'data-checked-grids="{len(result.scores) + 1}"' in dom
    assert result.evidence and re.search(r'data-checked-evidence="[1-9]', dom)  # a head's evidence maps drew
    assert 'class="selftest-error"' not in dom and console == []


@pytest.mark.browser
def test_a_broken_atlas_page_fails_its_selftest(result, tmp_path):
    browser = require_browser()
    page = render_page(result).replace('data-grid="roles"><tr>', 'data-grid="roles"><tr><td data-l="0" data-h="0"></td>', 1)
    dom, _ = open_page(browser, page, tmp_path, "atlas.html")
    status, detail = selftest_result(dom)
    assert status == "fail" and "roles" in detail
