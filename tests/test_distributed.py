"""Ring attention and ring statistics over torch.distributed: 2, 3 and 4 local gloo processes.

Each world size runs every case in one set of processes (tests/workers/ring_worker.py, a module file,
launched with a time limit, talking on 127.0.0.1 only); the shards are compared here with
single-process headlab.attention / headlab.attention_stats under FlashAttention's rule (outputs 2x,
gradients 3x the error of a plain implementation in the same precision, against float64).
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
from headlab.distributed import chunks, ring_attention, ring_attention_stats, shard, unshard
from headlab.errors import ConfigError, DistributedError, ShapeError

WORKER = Path(__file__).parent / "workers" / "ring_worker.py"
sys.path.insert(0, str(WORKER.parent))
import ring_worker  # noqa: E402

pytestmark = pytest.mark.distributed
NUMERIC = list(ring_worker.CASES)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, cases: list[str], tmp: Path, timeout: float = 240) -> list[dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port), str(tmp), *cases],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            logs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [torch.load(tmp / f"rank{r}.pt") if (tmp / f"rank{r}.pt").exists() else {"log": logs[r]}
            for r in range(world)]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"world{w}")
def world_results(request, tmp_path_factory):
    world = request.param
    return world, run_world(world, NUMERIC, tmp_path_factory.mktemp(f"ring{world}"))


def _plain(q, k, v, mask, causal, dtype):
    """Attention as the equations say it, in ``dtype`` (the yardstick's precision)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    return headlab.attention(q, k, v, mask=mask, causal=causal, backend="reference")


def _rule(name, got, ref64, plain, factor):
    err = (got.double() - ref64).abs().max().item()
    if got.dtype == torch.float64:  # the reference is its own plain implementation: a float64 tolerance
        assert err <= 1e-12, f"{name}: error {err:.3g} in float64"
        return
    yard = (plain.double() - ref64).abs().max().item()
    floor = 2 * ((ref64.to(got.dtype) + 0.3 - 0.3).double() - ref64).abs().max().item()
    # flash-attention's test rule: err <= factor * err_plain + 2 * |(ref + 0.3 - 0.3) - ref| in the low precision
    assert err <= factor * yard + floor, f"{name}: error {err:.3g} > {factor} x {yard:.3g} + {floor:.3g}"


@pytest.mark.parametrize("case", NUMERIC)
def test_ring_equals_single_process(world_results, case):
    world, results = world_results
    (q, k, v, do), kw = ring_worker.full_inputs(case, world)
    assert all(case in r for r in results), [r.get("error", r.get("log", ""))[-3000:] for r in results]
    lay = kw["layout"]
    got = {f: unshard([r[case][f] for r in results], layout=lay) for f in ("out", "dq", "dk", "dv")}
    # float64 reference with gradients, and the plain same-precision yardstick
    leaves64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = headlab.attention(*leaves64, mask=kw["mask"], causal=kw["causal"], backend="reference")
    g64 = torch.autograd.grad(ref, leaves64, do.double())
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    plain = _plain(*leaves, kw["mask"], kw["causal"], q.dtype)
    gp = torch.autograd.grad(plain, leaves, do)
    _rule(f"{case} out", got["out"], ref.detach(), plain.detach(), 2)
    for name, g, r64, rp in zip(("dq", "dk", "dv"), (got["dq"], got["dk"], got["dv"]), g64, gp):
        _rule(f"{case} {name}", g, r64, rp, 3)


@pytest.mark.parametrize("case", ["full-contiguous-gqa", "causal-zigzag-bf16"])
def test_bytes_sent_equal_the_cost_model(world_results, case):
    from headlab.costs import AttentionShape
    from headlab.costs.ring import ring_cost

    world, results = world_results
    (q, k, v, _do), kw = ring_worker.full_inputs(case, world)
    shape = AttentionShape(batch=q.shape[0], heads=q.shape[1], kv_heads=k.shape[1], q_len=q.shape[2],
                           head_dim=q.shape[3], dtype=q.dtype, causal=kw["causal"])
    pred = ring_cost(shape, ranks=world)
    for r in results:
        assert r[case]["sent_forward"] == pred.sent_forward_bytes
        assert r[case]["sent_backward"] == pred.sent_backward_bytes


@pytest.mark.parametrize("case", ["causal-zigzag-gqa", "window-causal-zigzag", "documents-zigzag",
                                  "full-contiguous-gqa"])
def test_ring_statistics_equal_single_process(world_results, case):
    world, results = world_results
    (q, k, _v, _do), kw = ring_worker.full_inputs(case, world)
    lay = kw["layout"]
    ref = headlab.attention_stats(q.double(), k.double(), mask=kw["mask"], causal=kw["causal"],
                                  stats=["lse", "entropy", "max_weight", "argmax", "mean_distance", "received"])
    for name in ("lse", "entropy", "max_weight", "mean_distance", "received"):
        got = unshard([r[case][f"stats.{name}"] for r in results], layout=lay).double()
        torch.testing.assert_close(got, getattr(ref, name), atol=2e-4, rtol=2e-4, msg=f"{case} {name}")
    arg = unshard([r[case]["stats.argmax"] for r in results], layout=lay)
    agree = (arg == ref.argmax).double().mean().item()
    assert agree > 0.99, f"{case}: argmax agrees on {agree:.1%} of rows"


def test_mismatched_ranks_fail_on_every_rank_and_a_dead_rank_times_out(tmp_path):
    res = run_world(2, ["mismatch"], tmp_path / "m", timeout=120)
    for r in res:
        assert "disagree" in r["mismatch"] and "heads: rank 0 has 2, rank 1 has 4" in r["mismatch"], r
    res = run_world(2, ["die"], tmp_path / "d", timeout=120)
    msg = res[0]["die"]
    assert msg.startswith("rank 0:") and "timeout" in msg, msg


def test_layouts_round_trip_and_balance():
    x = torch.arange(24).view(1, 1, 24, 1)
    for world in (1, 2, 3, 4):
        for layout in ("contiguous", "zigzag"):
            if 24 % (world * (2 if layout == "zigzag" else 1)):
                continue
            parts = [shard(x, rank=r, world_size=world, layout=layout) for r in range(world)]
            assert torch.equal(unshard(parts, layout=layout), x)
    # zigzag balances causal work: every rank sees the same number of visible (query, key) pairs
    n, world = 24, 3
    work = []
    for r in range(world):
        qpos = torch.cat([torch.arange(s, s + ln) for s, ln in chunks(n, rank=r, world_size=world, layout="zigzag")])
        work.append(int((qpos + 1).sum()))
    assert len(set(work)) == 1
    with pytest.raises(ShapeError, match="equal chunks"):
        chunks(10, rank=0, world_size=3, layout="zigzag")


def test_single_process_falls_back_and_bad_input_is_refused():
    q = torch.randn(1, 2, 8, 8)
    torch.testing.assert_close(ring_attention(q, q, q, causal=True), headlab.attention(q, q, q, causal=True))
    st = ring_attention_stats(q, q, causal=True)
    torch.testing.assert_close(st.lse, headlab.attention_stats(q, q, causal=True).lse)
    with pytest.raises(ConfigError, match="dropout"):
        ring_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ConfigError, match="functions of global positions"):
        ring_attention(q, q, q, mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ShapeError, match="same length"):
        ring_attention(q, q[:, :, :4], q[:, :, :4])
    with pytest.raises(ConfigError, match="layout"):
        ring_attention(q, q, q, layout="spiral")
    assert issubclass(DistributedError, RuntimeError)


def _two_ranks(worker: str, tmp_path, timeout: float) -> None:
    """Run ``tests/workers/WORKER RANK 2 PORT TMP`` as two gloo ranks on 127.0.0.1; both must exit 0."""
    port = _free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER.parent / worker), str(r), "2", str(port), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    logs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), [x[-3000:] for x in logs]


def test_data_parallel_importance_equals_one_process(tmp_path):
    """head_importance (and confidence) under 2 ranks: each takes half the examples, the sums are added."""
    import importance_worker

    _two_ranks("importance_worker.py", tmp_path, timeout=240)
    got = torch.load(tmp_path / "importance.pt")
    from headlab.interpret.heads.importance import head_confidence, head_importance

    m, texts = importance_worker.setup()
    torch.testing.assert_close(got["importance"], head_importance(m, texts, loss="lm", batch_size=2),
                               atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got["confidence"], head_confidence(m, texts, batch_size=2), atol=1e-6, rtol=1e-5)


def test_data_parallel_probe_and_explain_study_equal_one_process(tmp_path):
    """probe (hits, gold counts, surface measures, head map, gradient test) and the explain study under 2
    ranks: the sentences are split, the sums added / the records gathered by rank 0; equal to one process."""
    import json

    import analysis_worker

    (tmp_path / "tiny.conllu").write_text(analysis_worker.CONLLU, encoding="utf-8")
    (tmp_path / "data.tsv").write_text(analysis_worker.TSV, encoding="utf-8")
    _two_ranks("analysis_worker.py", tmp_path, timeout=300)

    from headlab.interpret.probing import ProbeResult, probe
    from headlab.interpret.saliency import study

    torch.set_num_threads(1)
    loaded = analysis_worker.setup()
    one = probe(loaded, tmp_path / "tiny.conllu", head_map_sentences=3, grad_sentences=4)
    one = ProbeResult.from_json(json.loads(json.dumps(one.to_json())))  # the rounding rank 0's file went through
    two = ProbeResult.from_json(json.loads((tmp_path / "probe.json").read_text()))
    assert two.sentences == one.sentences == 5 and two.tokens == one.tokens
    import numpy as np

    np.testing.assert_allclose(two.accuracy, one.accuracy, atol=1e-6)  # the JSON keeps 6 digits
    np.testing.assert_allclose(two.count, one.count)
    np.testing.assert_allclose(two.baseline_accuracy, one.baseline_accuracy)
    for name, v in one.per_head.items():
        np.testing.assert_allclose(two.per_head[name], v, rtol=1e-5, atol=1e-9, err_msg=name)
    assert "next-token" not in one.grad_note and np.isfinite(one.per_head["grad_sep"]).all()
    np.testing.assert_allclose(np.abs(two.head_map), np.abs(one.head_map), atol=1e-5)  # MDS: up to sign

    s1 = study(loaded, tmp_path / "data.tsv", tmp_path / "one", options=analysis_worker.study_options(),
               progress=False, figures=False)
    recs = {}
    for name in ("study", "one"):
        recs[name] = json.loads((tmp_path / name / "instances.json").read_text())["units"]
    assert len(recs["study"]) == len(recs["one"]) == 5  # every row once, written by rank 0
    for key, r in recs["one"].items():
        got = recs["study"][key]
        assert got["pred"] == r["pred"] and got["tokens"] == r["tokens"]
        for m, scores in r["scores"].items():
            np.testing.assert_allclose(got["scores"][m], scores, rtol=1e-9, atol=1e-12, err_msg=f"{key} {m}")
        assert got["permutation"]["median_tvd"] == pytest.approx(r["permutation"]["median_tvd"], rel=1e-9, abs=1e-12)
    tables = json.loads((tmp_path / "study" / "study.json").read_text())
    assert tables["instances"] == s1.instances == 5
    assert tables["kendall"]["gradient"]["mean"] == pytest.approx(s1.tables["kendall"]["gradient"]["mean"])
