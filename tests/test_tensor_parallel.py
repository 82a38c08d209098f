"""Tensor parallelism (transformers' own plan) read by headlab: captures and instruments equal one process.

A tiny Llama (GQA, and MHA at 4 ranks) or Qwen2 built from a config is saved to a folder; 2 (and 4) local gloo
ranks load it with ``headlab.load(..., tensor_parallel=True)`` (tests/workers/tp_worker.py, set up as torchrun
sets up a rank, talking on 127.0.0.1 only) and what they return is compared here with one process on the
unsharded model, in float32 (atol 1e-5): captures in global head order (gathered to every rank, to rank 0, or
kept sharded), edits and gates, statistics, head importance and confidence, the four ablations, and exact
patching. One launch per world does every instrument. The refusals need no second process: they are made from
the config, before loading.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import headlab
from headlab.errors import ConfigError, DistributedError, UnsupportedArchitectureError

WORKER = Path(__file__).parent / "workers" / "tp_worker.py"
sys.path.insert(0, str(WORKER.parent))
import tp_worker  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_llama(path: Path, heads: int, kv_heads: int, family: str = "llama") -> Path:
    """A 2-layer decoder of ``family`` (``llama``; ``qwen2``: q/k/v with biases, sharded with their rows)."""
    import transformers

    torch.manual_seed(0)
    prefix = {"llama": "Llama", "qwen2": "Qwen2"}[family]
    cfg = getattr(transformers, f"{prefix}Config")(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64)
    model = getattr(transformers, f"{prefix}ForCausalLM")(cfg)
    with torch.no_grad():  # biases are zero at init: make them count
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def run_world(world: int, model: Path, tmp: Path, *, torchrun: bool, timeout: float = 300,
              worker: Path = WORKER) -> list[dict]:
    """``world`` ranks of ``worker`` (tp_worker.py by default): started by ``torchrun`` itself, or one process per
    rank with torchrun's environment (as tests/test_distributed.py starts its ranks); both on 127.0.0.1 only.
    A worker takes ``RANK WORLD PORT OUT MODEL`` (``- - -`` under torchrun) and saves ``OUT/rank{r}.pt``."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("WORLD_SIZE", None)
    if torchrun:
        cmds = [[sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
                 f"--master_port={port}", str(worker), "-", "-", "-", str(tmp), str(model)]]
    else:
        cmds = [[sys.executable, str(worker), str(r), str(world), port, str(tmp), str(model)] for r in range(world)]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for c in cmds]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [x[-3000:] for x in logs]
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[(2, 4, 2, "llama", True), (4, 4, 4, "llama", False), (2, 4, 2, "qwen2", False)],
                ids=["llama-world2-gqa-torchrun", "llama-world4-mha", "qwen2-world2-bias"])
def sharded(request, tmp_path_factory):
    world, heads, kv, family, torchrun = request.param
    tmp = tmp_path_factory.mktemp(f"tp{world}{family}")
    model = tiny_llama(tmp / "model", heads, kv, family)
    torch.set_num_threads(1)
    results = run_world(world, model, tmp / "out", torchrun=torchrun)
    one = headlab.load(model)
    return world, heads, kv, results, {**tp_worker.runs(one), "instruments": tp_worker.instruments(one)}


def _close(got, ref, msg: str) -> None:
    """``got`` equals ``ref`` (tensors, or dicts of them, NaN where ``ref`` has NaN) to 1e-5."""
    if isinstance(ref, dict):
        assert sorted(got) == sorted(ref), msg
        for k in ref:
            _close(got[k], ref[k], f"{msg} {k}")
        return
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0, equal_nan=True, msg=msg)


@pytest.mark.distributed
def test_each_rank_holds_its_heads_on_the_real_weights(sharded):
    """Found by value on the sharded weights: rank r's q/k/v rows and o_proj columns are heads [r*H/w, (r+1)*H/w)."""
    world, H, Hkv, results, _ = sharded
    for r, res in enumerate(results):
        assert res["rank"] == r and res["world"] == world and res["n_heads"] == H and res["gates"] == (2, H)
        assert res["heads"] == list(range(r * H // world, (r + 1) * H // world))
        assert res["kv_heads"] == list(range(r * Hkv // world, (r + 1) * Hkv // world))
        for (layer, name), starts in res["layout"].items():
            first = res["kv_heads"][0] if name in ("k_proj", "v_proj") else res["heads"][0]
            assert first in starts, (r, layer, name, starts)


@pytest.mark.distributed
@pytest.mark.parametrize("path", ["load", "adapt"])
def test_capture_in_global_head_order_equals_one_process(sharded, path):
    world, H, Hkv, results, one = sharded
    for r, res in enumerate(results):
        got = res[path]
        assert sorted(got["plain"]) == sorted(one["plain"])
        for site, ref in one["plain"].items():
            if site.endswith((".q", ".pattern", ".z", ".head_out")):
                assert got["plain"][site].shape[1] == H, site
            if site.endswith((".k", ".v")):
                assert got["plain"][site].shape[1] == Hkv, site
            torch.testing.assert_close(got["plain"][site], ref, atol=1e-5, rtol=0, msg=f"rank {r} {path} {site}")
        for site, fields in one["stats"].items():  # map-free statistics, gathered field by field
            assert sorted(got["stats"][site]) == sorted(fields)
            for f, ref in fields.items():
                torch.testing.assert_close(got["stats"][site][f], ref, atol=1e-5, rtol=0, msg=f"rank {r} {site} {f}")


@pytest.mark.distributed
@pytest.mark.parametrize("path", ["load", "adapt"])
def test_edits_and_gates_address_global_heads(sharded, path):
    world, H, Hkv, results, one = sharded
    for r, res in enumerate(results):
        got = res[path]
        assert float(got["edited"]["blocks.1.attn.z"][:, 3].abs().sum()) == 0.0
        for site, ref in one["edited"].items():
            torch.testing.assert_close(got["edited"][site], ref, atol=1e-5, rtol=0, msg=f"rank {r} {site}")
        for name in ("edited_logits", "gated_logits"):
            torch.testing.assert_close(got[name], one[name], atol=1e-5, rtol=0, msg=f"rank {r} {name}")
        torch.testing.assert_close(got["logits"], one["logits"], atol=1e-5, rtol=0, msg=f"rank {r} logits")
    assert (one["gated_logits"] - one["logits"]).abs().max() > 1e-3  # the gate and the edit changed something
    assert (one["edited_logits"] - one["logits"]).abs().max() > 1e-3


@pytest.mark.distributed
def test_gathered_to_rank0_or_kept_where_the_heads_live(sharded):
    """gather="rank0": rank 0 holds every site in global order and the others nothing; gather="none": each rank
    its own heads (the statistics computed there), with their global indices."""
    world, H, Hkv, results, one = sharded
    ref = {**one["plain"], **one["stats"]}
    for r, res in enumerate(results):
        to0, kept = res["gathers"]["rank0"], res["gathers"]["none"]
        assert sorted(to0) == (sorted(ref) if r == 0 else []), r
        for site, value in to0.items():
            _close(value, ref[site], f"rank0 {site}")
        assert sorted(kept) == sorted(ref)
        for site, (value, heads) in kept.items():
            kind = site.rsplit(".", 1)[-1]
            n = Hkv if kind in ("k", "v") else H
            if kind == "resid_post":  # no head axis: the same on every rank
                _close(value, ref[site], f"rank {r} {site}")
                continue
            assert heads == list(range(r * n // world, (r + 1) * n // world)), (r, site, heads)
            want = {f: t[:, heads] for f, t in ref[site].items()} if kind == "stats" else ref[site][:, heads]
            _close(value, want, f"rank {r} {site}")


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["importance", "importance_kl", "confidence", "ablate_zero", "ablate_mean",
                                  "ablate_resample", "ablate_uniform", "patch", "patch_positions", "stats_kwargs"])
def test_every_instrument_equals_one_process(sharded, name):
    """Importance (its gates land on the ranks holding the heads, the derivative taken there and added over the
    group), confidence, the four ablations (single, pairs, keep-one, CKA), exact patching of every head site and of
    the residual stream, and map-free statistics with their options: on every rank, what one process gives."""
    world, H, Hkv, results, one = sharded
    ref = one["instruments"][name]
    for r, res in enumerate(results):
        _close(res["instruments"][name], ref, f"rank {r} {name}")
    def tensors(x):
        return [t for v in x.values() for t in tensors(v)] if isinstance(x, dict) else [x.float()]
    assert any(float(torch.nan_to_num(t).abs().max()) > 1e-4 for t in tensors(ref)), name  # something was measured


def test_a_world_that_does_not_divide_the_heads_is_refused_before_loading(tmp_path, monkeypatch):
    model = tiny_llama(tmp_path / "m", heads=4, kv_heads=2)
    (model / "model.safetensors").write_bytes(b"not weights")  # never read: the refusal comes from the config
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="4 query heads, which 3 does not divide"):
        headlab.load(model, tensor_parallel=True)
    monkeypatch.setenv("WORLD_SIZE", "4")  # divides 4 query heads, not 2 kv heads: transformers would cut a kv head
    with pytest.raises(ConfigError, match="2 key/value heads.*does not replicate kv heads"):
        headlab.load(model, tensor_parallel=True)


def test_a_family_without_a_plan_is_refused_with_the_reason(tmp_path, monkeypatch):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=64)).save_pretrained(tmp_path / "bert")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UnsupportedArchitectureError, match="'bert' has no tensor-parallel plan in transformers"):
        headlab.load(tmp_path / "bert", tensor_parallel=True)
    from headlab.models.transformer import Transformer, TransformerConfig

    Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4)).save(tmp_path / "own")
    with pytest.raises(UnsupportedArchitectureError, match="headlab's own and pruned models have no plan"):
        headlab.load(tmp_path / "own", tensor_parallel=True)


def test_tensor_parallel_outside_torchrun_says_how_to_launch(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(DistributedError, match="torchrun"):
        headlab.load(tiny_llama(tmp_path / "m", 4, 2), tensor_parallel=True)
