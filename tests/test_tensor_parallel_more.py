"""Tensor parallelism, continued: pruning, per-head KV decoding, the cost model, the memory cap and the 2-D mesh.

A tiny Llama (4 heads on 2 kv heads, 2 layers) is sharded over 2 local gloo ranks (tests/workers/tp_more_worker.py,
launched by ``run_world`` of tests/test_tensor_parallel.py) and what the ranks return is compared here with one
process on the unsharded model (float32, atol 1e-5), and with :mod:`headlab.costs.tensor_parallel`'s predictions,
exactly: the bytes of every parameter each rank holds (its DTensors' local shards), the bytes headlab's gathers
move (counted on ``torch.distributed.all_gather`` / ``gather`` as they run), the per-rank KV caches. A second
launch lays 4 ranks out as 2 data x 2 tensor and compares head importance and captures with one process.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import headlab
from headlab.interpret.heads.importance import head_confidence
from headlab.costs.tensor_parallel import (activation_bytes, gather_bytes, kv_cache_bytes_per_rank, local_size,
                                           patch_bytes, site_bytes, weight_bytes)
from headlab.errors import ConfigError, MemoryBudgetError

sys.path.insert(0, str(Path(__file__).parent))
from test_tensor_parallel import run_world, tiny_llama  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "tp_more_worker.py"
sys.path.insert(0, str(WORKER.parent))
import tp_more_worker as W  # noqa: E402
import tp_worker  # noqa: E402

HEADROOM = 0.9  # headlab.spec.memory_guard.HEADROOM: a request must fit 90% of what is available


def _shapes(model) -> dict[str, tuple]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _cap(one) -> tuple[int, int, int]:
    """(cap, one process's weight bytes, the larger rank's over 2 ranks): a cap the first exceeds and the second fits."""
    shapes, plan = _shapes(one.model), dict(one.model.tp_plan)
    whole = sum(torch.Size(s).numel() * 4 for s in shapes.values())
    rank = max(weight_bytes(shapes, plan, world=2, rank=r, itemsize=4).total for r in range(2))
    return int((whole + rank) / 2 / HEADROOM), whole, rank


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_more")
    model = tiny_llama(tmp / "m", heads=4, kv_heads=2)
    one = headlab.load(model)
    cap = _cap(one)
    saved = os.environ.get("TP_MORE_CAP")
    os.environ["TP_MORE_CAP"] = str(cap[0])
    try:
        results = run_world(2, model, tmp / "out", torchrun=False, worker=WORKER, timeout=900)
    finally:
        os.environ.pop("TP_MORE_CAP") if saved is None else os.environ.__setitem__("TP_MORE_CAP", saved)
    return model, one, cap, results, tmp / "out"


# -- the cost model, on numbers alone ---------------------------------------------------------------------------
def test_local_sizes_follow_torch_chunks():
    """torch's Shard(dim) of n over w ranks: chunks of ceil(n / w), the last ones shorter or empty."""
    for n, w in [(10, 4), (12, 4), (3, 4), (64, 2), (7, 3)]:
        want = [len(c) for c in torch.arange(n).chunk(w)] + [0] * (w - len(torch.arange(n).chunk(w)))
        assert [local_size(n, w, r) for r in range(w)] == want, (n, w)


def test_gather_and_patch_bytes_by_hand():
    # q of one layer, (B=2, H=4, L=12, d=16) float32 over 2 ranks: 3072 bytes per rank, the other's slice moves
    assert site_bytes("q", batch=2, seq=12, heads=4, kv_heads=2, head_dim=16, d_model=64, itemsize=4, world=2) == 3072
    assert gather_bytes(3072, world=2, to="all") == [3072, 3072]
    assert gather_bytes(3072, world=4, to="rank0") == [3 * 3072, 0, 0, 0]
    assert gather_bytes(3072, world=2, to="none") == [0, 0]
    shape = dict(batch=1, seq=5, heads=4, kv_heads=2, head_dim=8, d_model=32, itemsize=2)
    got = activation_bytes(["z", "v", "resid_post"], layers=3, world=2, to="rank0", **shape)
    z, v, resid = 1 * 2 * 5 * 8 * 2, 1 * 1 * 5 * 8 * 2, 1 * 5 * 32 * 2  # per rank
    assert got == {"held": [3 * (2 * z + 2 * v + resid), 0], "moved": [3 * (z + v), 0]}
    assert patch_bytes(["z", "resid_post"], layers=3, world=2, **shape) == [3 * z, 3 * z]
    with pytest.raises(ConfigError, match="gather='both'"):
        gather_bytes(1, world=2, to="both")


def test_a_style_the_cost_model_does_not_know_is_an_error():
    with pytest.raises(ConfigError, match="'mystery'.*known styles"):
        weight_bytes({"a.weight": (4, 4)}, {"a": "mystery"}, world=2)


# -- measured on 2 ranks ------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_each_ranks_parameter_bytes_equal_the_prediction(two):
    """Every parameter's local shard, measured on its DTensor, equals the plan's prediction; attention and MLP
    weights split in half, norms whole on each rank."""
    model, one, _, results, _ = two
    shapes, plan = _shapes(one.model), dict(one.model.tp_plan)
    whole = weight_bytes(shapes, {}, world=1, itemsize=4)
    assert whole.total == sum(p.numel() * 4 for p in one.model.parameters())
    for r, res in enumerate(results):
        got = weight_bytes(shapes, plan, world=2, rank=r, itemsize=4)
        assert got.by_param == res["params"], r
        assert got.by_group["attention"] * 2 == whole.by_group["attention"]
        assert got.by_group["mlp"] * 2 == whole.by_group["mlp"]
        assert got.by_group["norms"] == whole.by_group["norms"] > 0
        assert got.total < whole.total


@pytest.mark.distributed
def test_a_cap_one_process_exceeds_and_two_ranks_fit(two, tmp_path, monkeypatch):
    """Under the cap the ranks loaded (and ran everything below); one process is refused with the estimate,
    before any weight is read (a folder whose weights are not weights is refused the same way)."""
    model, one, (cap, whole, rank), results, _ = two
    assert rank <= HEADROOM * cap < whole and len(results) == 2
    monkeypatch.setenv("HEADLAB_MEMORY_LIMIT", str(cap))
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    for path in (model, broken):
        with pytest.raises(MemoryBudgetError, match="loading the weights of .* needs about") as e:
            headlab.load(path)
        assert e.value.estimate_bytes == whole


@pytest.mark.distributed
def test_gathers_and_a_patch_move_the_predicted_bytes(two):
    """The bytes each rank received (counted on the collectives) for a capture of every head site and for an exact
    patch of z and v equal the prediction, and half of what one process's sites hold (the other rank's half)."""
    model, one, _, results, _ = two
    x = tp_worker.inputs()
    shape = dict(batch=2, seq=12, heads=4, kv_heads=2, head_dim=16, d_model=64, itemsize=4)
    kinds = [s.rsplit(".", 1)[-1] for s in tp_worker.SITES]
    sites = headlab.capture(one, x, tp_worker.SITES)
    half = sum(t.nbytes for k, t in sites.items() if "resid" not in k) // 2
    for to in ("all", "rank0", "none"):
        want = activation_bytes(kinds, layers=2, world=2, to=to, **shape)["moved"]
        assert [res["moved"][to] for res in results] == want, to
    assert [res["moved"]["all"] for res in results] == [half, half]
    assert [res["moved"]["patch"] for res in results] == patch_bytes(["z", "v"], layers=2, world=2,
                                                                      **{**shape, "seq": 8})


@pytest.mark.distributed
def test_a_balanced_pruning_equals_one_process(two):
    model, one, _, results, out = two
    x = tp_worker.inputs()
    ref = headlab.prune_heads(one, W.PRUNE)
    gqa = headlab.prune_heads(headlab.load(out / "gqa"), W.PRUNE_GQA)
    for r, res in enumerate(results):
        p = res["prune"]
        torch.testing.assert_close(p["logits"], ref.adapter.forward(x).logits, atol=1e-5, rtol=0, msg=f"rank {r}")
        assert p["kept"] == ref.kept and p["heads"] == 1 and p["q_local"] == (16, 64) and p["untouched"]
        torch.testing.assert_close(res["prune_gqa"]["logits"], gqa.adapter.forward(x).logits, atol=1e-5, rtol=0)
        assert res["prune_gqa"]["kv_local"] == (16, 64)  # 2 kv heads per rank, one whole group gone from each
    assert (ref.adapter.forward(x).logits - one.adapter.forward(x).logits).abs().max() > 1e-3


@pytest.mark.distributed
def test_an_unbalanced_pruning_is_refused_with_a_balanced_one(two):
    _, _, _, results, _ = two
    for res in results:
        one_rank, one_layer = res["prune"]["one_rank"], res["prune"]["one_layer"]
        assert one_rank and "unequal shards (layer 0: rank 0 0q/0kv, rank 1 2q/1kv" in one_rank
        assert "e.g. {0: [0, 2], 1: [0, 2]}" in one_rank
        assert one_layer and "layer 1: rank 0 2q/1kv, rank 1 2q/1kv" in one_layer
        assert "e.g. {0: [1, 3], 1: [0, 2]}" in one_layer


@pytest.mark.distributed
def test_decoding_with_kv_policies_equals_one_process(two):
    """Greedy tokens under no policy, a window and a split equal one process's; each rank's cache holds its own kv
    heads (measured), as predicted, and together what one process holds."""
    _, one, _, results, _ = two
    for name, policy in W.policies().items():
        ref = headlab.generate(one, W.prompt(), policy=policy, max_new_tokens=6)
        assert ref.kv_bytes_per_rank is None
        want = kv_cache_bytes_per_rank(policy or headlab.kv.Policy.uniform("full"), kv_heads=[2, 2], world=2,
                                       tokens=results[0]["decode"][name]["held"], head_dim=16, prompt=9)
        for r, res in enumerate(results):
            got = res["decode"][name]
            assert torch.equal(got["ids"], ref.ids), (name, r)
            assert got["per_rank"] == want and got["kv_bytes"] == sum(want) == ref.kv_bytes, (name, r)
            assert got["json_per_rank"] == want, (name, r)  # and the result file says it
    split = results[0]["decode"]["split"]["per_rank"]
    assert split[0] < split[1]  # rank 0's kv head is windowed in both layers, rank 1's full


# -- 4 ranks as 2 data x 2 tensor ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_mesh")
    model = tiny_llama(tmp / "m", heads=4, kv_heads=2)
    import transformers

    from conftest import save_word_level  # the probe reads words: a tokenizer over the treebank's words
    save_word_level(model, transformers.AutoModelForCausalLM.from_pretrained(model),
                    ["<pad>", "<unk>"] + W.TREEBANK_WORDS)
    os.environ["TP_MORE_MESH"] = "2"
    try:
        results = run_world(4, model, tmp / "out", torchrun=False, worker=WORKER, timeout=900)
    finally:
        os.environ.pop("TP_MORE_MESH")
    return headlab.load(model), results


@pytest.mark.distributed
def test_a_2x2_mesh_splits_examples_across_groups_and_equals_one_process(mesh, tmp_path):
    one, results = mesh
    g = torch.Generator().manual_seed(5)
    texts = [torch.randint(0, 64, (n,), generator=g) for n in (7, 11, 11, 9, 6)]
    ref = headlab.head_importance(one, texts, loss="lm", batch_size=2)
    conf = head_confidence(one, texts, batch_size=2)  # a mean over tokens: counts added over groups once
    cap = headlab.capture(one, tp_worker.inputs(), ["blocks.*.attn.z", "blocks.*.attn.k"])
    for r, res in enumerate(results):
        assert (res["tp_rank"], res["tp_world"], res["data_rank"]) == (r % 2, 2, r // 2)
        assert res["heads"] == [2 * (r % 2), 2 * (r % 2) + 1]
        assert res["examples"] == [[0, 2, 4], [1, 3]][r // 2]
        torch.testing.assert_close(res["importance"], ref, atol=1e-5, rtol=0, msg=f"rank {r}")
        torch.testing.assert_close(res["confidence"], conf, atol=1e-5, rtol=0, msg=f"rank {r} confidence")
        for site, t in cap.items():
            torch.testing.assert_close(res["capture"][site], t, atol=1e-5, rtol=0, msg=f"rank {r} {site}")
    assert float(ref.abs().max()) > 1e-4
    probe = W.probe_figures(one, tmp_path / "tb.conllu")
    assert probe["sentences"] == 5 and float(probe["per_head grad_sep"].isnan().logical_not().sum()) > 0
    for r, res in enumerate(results):  # each group probes its share of the sentences; the sums are added once
        for k, t in probe.items():
            got = res["probe"][k]
            if isinstance(t, torch.Tensor):
                torch.testing.assert_close(got.double(), t.double(), atol=1e-5, rtol=0, equal_nan=True,
                                           msg=f"rank {r} probe {k}")
            else:
                assert got == t, (r, k)


def test_tensor_parallel_groups_must_divide_the_world(tmp_path, monkeypatch):
    model = tiny_llama(tmp_path / "m", heads=4, kv_heads=2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="tensor_parallel=3 over 4 ranks"):
        headlab.load(model, tensor_parallel=3)
    with pytest.raises(ConfigError, match="tensor_parallel=0"):
        headlab.load(model, tensor_parallel=0)


@pytest.mark.parametrize("world,rank", [(0, 0), (-1, 0), (2, 2), (2, -1)])
def test_the_cost_model_refuses_a_world_or_rank_that_cannot_be(world, rank):
    from headlab.costs import tensor_parallel as ct

    plan, shapes = {"layers.*.q": "colwise"}, {"layers.0.q.weight": (64, 32)}
    with pytest.raises(ConfigError, match="give a world of at least 1"):
        ct.weight_bytes(shapes, plan, world=world, rank=rank)
    if rank == 0:
        for call in (lambda: ct.gather_bytes(10, world=world), lambda: ct.activation_bytes(["z"], layers=1, world=world),
                     lambda: ct.kv_cache_bytes_per_rank(None, kv_heads=[2], world=world, tokens=4, head_dim=8)):
            with pytest.raises(ConfigError, match="give a world of at least 1"):
                call()
