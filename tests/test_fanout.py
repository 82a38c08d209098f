"""Prefix sharing (headlab.models.fanout): running the layers below ``start`` once per example and
fanning out there gives the model's output on the repeated inputs, for every supported family, on
a right-padded batch, with and without edits at the fanned-out layers; ablation studies that use
it equal the same studies run on repeated inputs."""

from __future__ import annotations

import pytest
import torch

from headlab.errors import ConfigError
from headlab.models import adapt
from headlab.models.fanout import blocks, fan_out
from test_models import CASE_NAMES, _build, _inputs


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("start", [0, 1])
@pytest.mark.parametrize("share", [True, False], ids=["shared-attention", "per-copy-attention"])
def test_fan_out_equals_repeated_inputs(name, start, share):
    model = _build(name).eval()
    a = adapt(model)
    assert blocks(a) is not None and len(blocks(a)) == a.n_layers
    inputs = _inputs(padded=True)
    copies = 3
    rep = {k: v.repeat(copies, 1) for k, v in inputs.items()}
    with torch.no_grad():
        want = a.forward(rep)
        with fan_out(a, start, copies, share_attention=share):
            got = a.forward(inputs)
    field = "logits" if hasattr(want, "logits") and want.logits is not None else "last_hidden_state"
    w, g = getattr(want, field), getattr(got, field)
    assert g.shape == w.shape
    real = rep["attention_mask"].bool()
    torch.testing.assert_close(g[real], w[real], atol=2e-5, rtol=1e-4)
    # an edit at the fanned-out layer sees copies * B rows and acts per copy
    def zero_copy_1(z, site):
        z = z.clone()
        z.view(copies, -1, *z.shape[1:])[1, :, 0] = 0  # head 0 of copy 1 only
        return z

    with torch.no_grad(), a.hooks({f"blocks.{a.n_layers - 1}.attn.z": zero_copy_1}):
        want = getattr(a.forward(rep), field)
        with fan_out(a, start, copies, share_attention=share):
            got = getattr(a.forward(inputs), field)
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(got[2:4][real[2:4]], got[:2][real[:2]])  # copy 1 differs from copy 0


def test_fan_out_refuses_a_bad_start():
    a = adapt(_build(CASE_NAMES[0]))
    with pytest.raises(ConfigError, match="start=9 is not a layer"):
        with fan_out(a, 9, 2):
            pass
