"""``docs/notebooks/tour.ipynb`` in a real Jupyter kernel (nbclient), and its pages in headless Chromium.

The tour walks the main calls on the bundled models. Every result with a page shows it inline
(``_repr_html_``): headlab's one shell (:mod:`headlab.interpret.shell`) in a sandboxed iframe, offline.
Here each cell must run without an error, the figures it prints must be right (the mechanism equals
PyTorch's, the seed's 32 GiB), and every inline page must be a whole page with the one stylesheet and
no network reference, which Chromium opens: the pages that check themselves (``#selftest``: the report,
explain, heads) report a pass, and none logs a script error.

nbformat, nbclient and ipykernel are test extras (``pip install -e '.[test]'``, which ``make test`` runs), so a
missing one takes conftest's :func:`require` rule: a skip on a developer's machine, a failure under CI
(``CI=true``), where a skip would silently stop testing the notebook.
"""

from __future__ import annotations

import ast
import html
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from conftest import require, require_browser
from headlab.interpret import shell
from test_browser import open_page, selftest_result

pytestmark = [pytest.mark.smollm2, pytest.mark.browser]
TOUR = Path(__file__).resolve().parents[1] / "docs" / "notebooks" / "tour.ipynb"

EXTRAS = ("nbformat", "nbclient", "ipykernel")  # ipykernel: the "python3" kernel the tour runs in


def _extras():
    """``(nbformat, nbclient)``, or conftest's :func:`require` rule (skip; fail under CI) naming what is missing."""
    missing = [name for name in EXTRAS if importlib.util.find_spec(name) is None]
    require(not missing, f"the notebook test needs the test extras ({', '.join(missing)} missing): "
                         "pip install -e '.[test]'")
    return importlib.import_module("nbformat"), importlib.import_module("nbclient")


@pytest.fixture(scope="module")
def tour():
    nbformat, nbclient = _extras()
    nb = nbformat.read(TOUR, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(TOUR.parent)}}
                            ).execute()
    return nb


def _results(nb) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "execute_result"]


def _pages(nb) -> dict[str, str]:
    """``{result type: the page inside its iframe}`` for every inline page."""
    pages = {}
    for o in _results(nb):
        frag = o["data"].get("text/html")
        if frag is None:
            continue
        m = re.fullmatch(r'<iframe class="headlab-page" sandbox="allow-scripts" style="[^"]*" srcdoc="(.*)"></iframe>',
                         frag, re.S)
        assert m, f"not an inline headlab page: {frag[:200]}"
        pages[o["data"]["text/plain"].split("(")[0]] = html.unescape(m.group(1))
    return pages


def test_the_tour_runs_and_prints_what_it_says(tour):
    errors = [o for c in tour.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    plain = [o["data"]["text/plain"] for o in _results(tour)]
    assert float(plain[0]) < 1e-5  # headlab.attention against torch's scaled_dot_product_attention
    assert ast.literal_eval(plain[1]) == {"reference": 32.0, "tiled": 0.0}  # the seed text's 32 GB, and tiles' none


def test_every_result_with_a_page_renders_inline_through_the_one_shell(tour):
    pages = _pages(tour)
    assert set(pages) == {"ReportResult", "NormsResult", "RolloutResult", "FlowResult", "Explanation",
                          "ImportanceResult", "ProbeResult"}
    css = shell.stylesheet()
    for kind, page in pages.items():
        assert page.startswith("<!DOCTYPE html>"), kind
        assert css in page, f"{kind}: not the one stylesheet"
        assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', page), f"{kind} fetches from the network"


def test_the_inline_pages_open_in_chromium(tour, tmp_path):
    browser = require_browser()
    for kind, page in _pages(tour).items():
        dom, console = open_page(browser, page, tmp_path, name=f"{kind}.html")
        assert 'class="selftest-error"' not in dom, f"{kind}: a script error"
        assert "<main>" in dom, f"{kind}: the page did not load"
        assert not console, f"{kind}: console messages {console}"
        if kind in ("ReportResult", "Explanation", "ImportanceResult"):
            status, text = selftest_result(dom)
            if kind == "Explanation":  # explain's self-test writes into its own <pre id="selftest">
                m = re.search(r'<pre id="selftest"[^>]*>(.*?)</pre>', dom, re.S)
                text = m.group(1) if m else "no self-test output"
                status = "pass" if text.strip() == "selftest: pass" else "fail"
            assert status == "pass", f"{kind}: {text}"
