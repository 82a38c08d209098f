"""Tensor parallelism (issue 32, items 3-4): the head atlas, path patching and attribution patching on a model
sharded by transformers' own plan equal one process.

A tiny Llama (GQA over 2 ranks, started by torchrun; MHA over 4 ranks, one process per rank) built from a config,
its queries and keys sharpened so that the heads differ, is saved to a folder; the ranks load it with
``headlab.load(..., tensor_parallel=True)`` and run tests/workers/tp_atlas_worker.py's ``instruments`` (one launch
per world); the same function runs here on the unsharded model, in float32. Compared: the atlas's scores of every
kind (previous-token and induction among them), its OV copying scores, its causal checks (the heads gated, the
per-example effects of the top-k set and of every random draw, the verdicts), the needle runs and the evidence
maps; path patching into the logits and into receivers' q, k and v; attribution patching of every head site,
whole and per position; and the residual stream's gradient at every layer under the sharded backward, which
attribution relies on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import headlab
from headlab.interpret.atlas import Atlas

HERE = Path(__file__).parent
WORKER = HERE / "workers" / "tp_atlas_worker.py"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(WORKER.parent))
import tp_atlas_worker  # noqa: E402
from test_tensor_parallel import run_world, tiny_llama  # noqa: E402


def sharpened(path: Path, heads: int, kv_heads: int) -> Path:
    """:func:`tiny_llama` with q_proj and k_proj scaled by 6: at initialisation every head attends almost
    uniformly (all heads score alike), so a head put in the wrong place would go unseen; sharpened, they differ."""
    from transformers import AutoModelForCausalLM

    tiny_llama(path, heads, kv_heads)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    model.save_pretrained(path)
    return path


# the world-4 launch (minutes on 2 cores) runs in `make test-slow`
@pytest.fixture(scope="module", params=[(2, 4, 2, True), pytest.param((4, 4, 4, False), marks=pytest.mark.slow)],
                ids=["llama-world2-gqa-torchrun", "llama-world4-mha"])
def sharded(request, tmp_path_factory):
    world, heads, kv, torchrun = request.param
    tmp = tmp_path_factory.mktemp(f"tpatlas{world}")
    model = sharpened(tmp / "model", heads, kv)
    torch.set_num_threads(1)
    results = run_world(world, model, tmp / "out", torchrun=torchrun, worker=WORKER, timeout=600)  # a busy machine
    one = tp_atlas_worker.instruments(headlab.load(model))
    return world, [r["instruments"] for r in results], one


def _close(got, ref, msg: str, atol: float = 1e-5) -> None:
    """``got`` equals ``ref`` (tensors, or dicts of them; NaN where ``ref`` has NaN) to ``atol``."""
    if isinstance(ref, dict):
        assert sorted(got) == sorted(ref), msg
        for k in ref:
            _close(got[k], ref[k], f"{msg} {k}", atol)
        return
    torch.testing.assert_close(got, ref, atol=atol, rtol=0, equal_nan=True, msg=msg)


@pytest.mark.distributed
def test_atlas_scores_equal_one_process(sharded):
    """Every kind's score and the OV copying score, head by head in global order, on every rank."""
    world, results, one = sharded
    ref = Atlas.from_json(one["atlas"])
    assert {"previous_token", "induction", "copying"} <= set(ref.scores)
    for r, res in enumerate(results):
        got = Atlas.from_json(res["atlas"])
        assert got.kinds == ref.kinds and got.skipped == ref.skipped, r
        for kind, grid in ref.scores.items():
            _close(got.scores[kind].double(), grid.double(), f"rank {r} {kind}")
        assert got.labels == ref.labels, r
        assert got.settings["needle_runs"] == ref.settings["needle_runs"], r
        assert sorted(got.evidence) == sorted(ref.evidence), r
        for key, ev in ref.evidence.items():  # the maps of each kind's top heads (3 decimals)
            _close(torch.tensor(got.evidence[key]["map"]), torch.tensor(ev["map"]), f"rank {r} {key}", 1.1e-3)
    spread = ref.scores["previous_token"].max() - ref.scores["previous_token"].min()
    assert spread > 0.03  # the heads differ: a head put in the wrong place would show


@pytest.mark.distributed
def test_atlas_causal_checks_equal_one_process(sharded):
    """The checks gate the same heads (the top-k of each kind and the same random draws), and every per-example
    effect, each draw's, the baseline and the verdict are one process's: the gates landed on the ranks holding
    those heads, and every rank ran every configuration."""
    world, results, one = sharded
    ref = one["atlas"]["verdicts"]
    assert {"previous_token", "induction"} <= set(ref)
    for r, res in enumerate(results):
        got = res["atlas"]["verdicts"]
        assert sorted(got) == sorted(ref), r
        for kind, v in ref.items():
            w = got[kind]
            assert (w["verdict"], w["heads"], w["draws"], w["n_examples"]) == \
                (v["verdict"], v["heads"], v["draws"], v["n_examples"]), (r, kind)
            assert w["baseline"] == pytest.approx(v["baseline"], abs=1e-5), (r, kind)
            _close(torch.tensor(w["effects"]["targeted"]), torch.tensor(v["effects"]["targeted"]), f"rank {r} {kind}")
            _close(torch.tensor(w["effects"]["random"]), torch.tensor(v["effects"]["random"]), f"rank {r} {kind}")
    assert any(abs(e) > 1e-3 for v in ref.values() for e in v["effects"]["targeted"])  # gating changed something


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["path_logits", "path_q", "path_kv", "attribution", "attribution_positions"])
def test_path_and_attribution_patching_equal_one_process(sharded, name):
    """Path patching (senders frozen and receivers' inputs put in on the ranks holding them) and attribution
    patching (each rank's heads' gradients, added over the group), on every rank, equal one process; heads that
    cannot reach a receiver are NaN in both."""
    world, results, one = sharded
    ref = one[name]
    for r, res in enumerate(results):
        _close(res[name], ref, f"rank {r} {name}")
    tensors = list(ref.values()) if isinstance(ref, dict) else [ref]
    assert any(float(torch.nan_to_num(t).abs().max()) > 1e-4 for t in tensors), name  # something was measured


@pytest.mark.distributed
def test_the_sharded_backward_gives_the_whole_gradient(sharded):
    """d(logit difference)/d(resid_pre) at every layer, taken on the sharded model, equals one process's on every
    rank: layer 0's gradient has crossed every sharded attention and MLP backward, so a rank that kept only its
    own heads' share (no all-reduce of the column-parallel input gradients) would differ."""
    world, results, one = sharded
    for r, res in enumerate(results):
        _close(res["residual_grads"], one["residual_grads"], f"rank {r}")
    assert all(float(g.abs().max()) > 1e-2 for g in one["residual_grads"].values())


def test_site_grads_equal_capture_grads_on_one_process():
    """Unsharded, :func:`headlab.models.tp_grads.site_grads` (identity per-head edits kept in the graph) gives the
    values and gradients that ``capture(..., grads=True)`` records, at every head site, with every head."""
    from headlab.interpret.patching import logit_diff
    from headlab.interpret.patching.metrics import evaluate, logits_of
    from headlab.models.loader import resolve
    from headlab.models.tp_grads import site_grads
    from headlab.models.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(vocab_size=30, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                          causal=True)).eval()
    adapter, _ = resolve(model)
    ids = torch.randint(0, 30, (2, 7))
    metric = logit_diff(3, 5)

    def scalar(out):
        return evaluate(metric, logits_of(out), 2).mean()

    sites = {adapter.site_name(l, k): k for l in range(2) for k in ("z", "q", "k", "v", "pattern")}
    got = site_grads(adapter, ids, sites, scalar)
    ref = headlab.capture(adapter, ids, list(sites), grads=True, scalar=scalar)
    assert got.scalar == pytest.approx(float(ref.scalar), abs=1e-6)
    for name, kind in sites.items():
        assert got.heads[name] == range(2 if kind in ("k", "v") else 4), name
        torch.testing.assert_close(got.values[name], ref[name], atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(got.grads[name], ref.grads[name], atol=1e-6, rtol=0, msg=name)
        assert float(ref.grads[name].abs().max()) > 0, name
