"""Tensor parallelism for models read by structure equals one process, as the declared families' does.

Three types no headlab family declares (tests/architectures.py's STRUCTURE list), one launch of 2 local gloo ranks
for all three (tests/workers/tp_structure_worker.py, talking on 127.0.0.1 only), each loaded with
``headlab.load(..., tensor_parallel=True)``: read and checked whole, then cut by heads
(:mod:`headlab.models.tp_structure`):

- ``granite``: separate q/k/v with grouped-query heads (4 query, 2 kv), cut by the config's own plan (which shards
  the MLP and the embeddings too);
- ``camembert``: an encoder with separate ``query``/``key``/``value`` (no plan in transformers: the plan is derived
  from the projections found);
- ``gpt_bigcode`` with ``multi_query=False``: one fused ``c_attn`` laid out per head ``(H, 3, d)``, reshaped by the
  module with its own ``num_heads`` (set to a rank's count), the plan derived.

Compared with one process on the unsharded model, in float32 (atol 1e-5): the model's output, every head site
captured in global head order, an edit addressed by global head, a gate, W_V/W^O read whole, and head importance;
each rank's shards are found by value among the unsharded weights' rows (columns of W^O). The refusals need no second
process: a world that does not divide the kv heads is refused from the heads found, and the layouts headlab cannot
cut by heads (fused ``[Q|K|V]`` blocks, GPT-2's ``Conv1D``, encoder-decoders) from the plan.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers as T
from test_tensor_parallel import run_world

import headlab
from headlab.errors import ConfigError, UnsupportedArchitectureError

sys.path.insert(0, str(Path(__file__).parent))
import architectures as A  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "tp_structure_worker.py"
sys.path.insert(0, str(WORKER.parent))
import tp_structure_worker as W  # noqa: E402

NAMES = ["granite", "camembert", "gpt_bigcode"]
SOURCE = {"granite": "config", "camembert": "structure", "gpt_bigcode": "structure"}


def bigcode(multi_query: bool) -> torch.nn.Module:
    """GPTBigCode (a STRUCTURE type) with a fused c_attn: per head ``(H, 3, d)``, or ``[Q | K | V]`` with one kv head
    when ``multi_query`` (the sweep's)."""
    torch.manual_seed(0)
    return T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(
        vocab_size=A.V, n_embd=A.E, n_layer=A.LAYERS, n_head=A.H, n_positions=A.POS, multi_query=multi_query,
        bos_token_id=1, eos_token_id=2, attn_implementation="eager")).eval()


def build(name: str) -> torch.nn.Module:
    if name == "gpt_bigcode":
        model = bigcode(False)
        with torch.no_grad():  # biases are zero at init: make them count
            for n, p in model.named_parameters():
                if n.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
        return model
    return A.build(name)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_structure")
    for name in NAMES:
        build(name).save_pretrained(tmp / "models" / name)
    results = run_world(2, tmp / "models", tmp / "out", torchrun=False, worker=WORKER)
    ones = {name: W.runs(headlab.load(tmp / "models" / name)) for name in NAMES}
    return results, ones


@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_each_rank_holds_whole_heads_by_the_plan(sharded, name):
    """Rank r holds query heads [2r, 2r+2) and kv heads [r Hkv/2, ...): its shards of q/k/v (or of the fused c_attn)
    and of W^O equal those rows (columns) of the unsharded weights, found by value."""
    results, _ = sharded
    d = A.D
    for r, res in enumerate(results):
        got = res[name]
        H, Hkv = A.H, (A.KV if name == "granite" else A.H)
        assert got["by_structure"] and got["source"] == SOURCE[name] and (got["rank"], got["world"]) == (r, 2)
        assert got["heads"] == list(range(r * H // 2, (r + 1) * H // 2))
        assert got["kv_heads"] == list(range(r * Hkv // 2, (r + 1) * Hkv // 2))
        starts = {(layer, n.rsplit(".", 1)[0]): v for (layer, n), v in got["shards"].items()}
        for layer in range(A.LAYERS):
            assert starts[(layer, "out")] == [r * H // 2 * d], (name, r, layer)
            if name == "gpt_bigcode":  # (H, 3, d): a rank's rows are its heads' q, k and v together
                assert starts[(layer, "c_attn")] == [r * H // 2 * 3 * d]
                continue
            q, k, v = ("q_proj", "k_proj", "v_proj") if name == "granite" else ("query", "key", "value")
            assert starts[(layer, q)] == [r * H // 2 * d], (name, r, layer)
            assert starts[(layer, k)] == starts[(layer, v)] == [r * Hkv // 2 * d], (name, r, layer)


@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_outputs_captures_and_importance_equal_one_process(sharded, name):
    results, ones = sharded
    one = ones[name]
    # the one-process figures are not trivial: the edit and the gate change the output, heads differ in importance
    assert (one["edited"] - one["output"]).abs().max() > 1e-4 and (one["gated"] - one["output"]).abs().max() > 1e-4
    assert one["importance"].shape == (A.LAYERS, A.H) and one["importance"].std() > 1e-6
    assert sorted(one["captures"]) == sorted(f"blocks.{i}.attn.{s}" for i in range(A.LAYERS)
                                             for s in ("q", "k", "v", "pattern", "z", "head_out"))
    for r, res in enumerate(results):
        got = res[name]
        for key in ("output", "edited", "gated", "importance"):
            torch.testing.assert_close(got[key], one[key], atol=1e-5, rtol=0, msg=f"{name} rank {r} {key}")
        for site, t in one["captures"].items():
            assert got["captures"][site].shape == t.shape, (name, r, site)  # every head, in global order
            torch.testing.assert_close(got["captures"][site], t, atol=1e-5, rtol=0, msg=f"{name} rank {r} {site}")
        for a, b in zip(got["value_path"], one["value_path"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=f"{name} rank {r} value path")


def test_kv_heads_the_world_does_not_divide_are_refused_with_the_numbers(tmp_path, monkeypatch):
    """GPTBigCode's multi-query attention has 1 kv head, so 2 ranks cannot hold whole heads: a ConfigError naming the
    numbers, from the config, before any weight is read; where a config does not say, the heads found say it
    (:func:`~headlab.models.tp_structure.check_heads`, before anything is cut)."""
    from headlab.models.tp_structure import check_heads

    bigcode(True).save_pretrained(tmp_path / "mq")
    (tmp_path / "mq" / "model.safetensors").write_bytes(b"not weights")  # never read
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="over 2 ranks: the 'gpt_bigcode' model has 1 key/value heads, which 2 does "
                                          "not divide.*use at most 1 ranks"):
        headlab.load(tmp_path / "mq", tensor_parallel=True)
    with pytest.raises(ConfigError, match="over 4 ranks: the 'x' model has 6 query heads, which 4 does not divide"):
        check_heads("x", 6, 2, 4)
    check_heads("x", 8, 2, 2)  # whole heads on each rank


@pytest.mark.parametrize("model, match", [
    (lambda: bigcode(True), r"one fused projection laid out \[Q \| K \| V\]"),
    (lambda: A.build("mbart"), "'mbart' encoder-decoder read by structure"),
    (lambda: A.build("gpt2"), "GPT-2 Conv1D"),
])
def test_layouts_that_cannot_be_cut_by_heads_are_refused(model, match):
    """What a contiguous cut of rows would not keep as whole heads, and what transformers' styles cannot cut."""
    from headlab.models import adapt
    from headlab.models.tp_structure import shard_plan

    m = model()
    adapter = adapt(m)
    with pytest.raises(UnsupportedArchitectureError, match=match):
        shard_plan(m, adapter)
    adapter.close()


def test_the_plan_cuts_the_projections_found_and_nothing_else():
    """camembert has no plan in transformers: the derived plan names exactly its q/k/v (colwise) and W^O (rowwise)
    of every layer, weights and biases; granite's own plan cuts them the same way and is taken as it is."""
    from headlab.models import adapt
    from headlab.models.tp_structure import shard_plan

    m = A.build("camembert")
    a = adapt(m)
    plan, source = shard_plan(m, a)
    a.close()
    want = {}
    for layer in range(A.LAYERS):
        base = f"encoder.layer.{layer}.attention"
        for n in ("query", "key", "value"):
            want |= {f"{base}.self.{n}": "colwise", f"{base}.self.{n}.weight": "colwise",
                     f"{base}.self.{n}.bias": "colwise"}
        want |= {f"{base}.output.dense": "rowwise", f"{base}.output.dense.weight": "rowwise",
                 f"{base}.output.dense.bias": "rowwise"}
    assert source == "structure" and plan == want
    g = A.build("granite")
    a = adapt(g)
    plan, source = shard_plan(g, a)
    a.close()
    assert source == "config" and plan == g._expand_parallel_plan(dict(g.tp_plan))
    assert plan["model.layers.1.self_attn.k_proj.weight"] == "colwise" and plan["model.layers.1.mlp.down_proj"] == "rowwise"
