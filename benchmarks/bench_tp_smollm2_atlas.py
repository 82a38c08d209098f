"""The ``atlas`` part of ``bench_tp_smollm2.py``: the head atlas of SmolLM2-135M over 3 tensor-parallel ranks against
one process (issue 32's done-when: induction and previous-token, with their causal checks).

Every rank runs ``headlab.atlas`` with :data:`SETTINGS` (the same calls as one process: each rank scores the heads it
holds and the grids are added over the group; the checks' gates land on the ranks holding the heads). Rank 0 keeps
every rank's atlas (all-gathered) in ``results/tp_smollm2_atlas_tmp.json`` (ignored by git); the one-process run
computes the same atlas and compares, rank by rank and head by head:

- the scores (previous_token, induction and the OV copying score) in full precision, for all 270 heads;
- each kind's check: the heads gated (the top k and every random draw), the number of examples and the verdict must
  be identical; every per-example effect (targeted and random) and the verdict's figures (baseline, targeted mean,
  its interval, the random mean) are compared as numbers;
- the evidence maps of each kind's top heads (stored to 3 decimals).

The rule is FlashAttention's, as tests/test_distributed.py applies it: one process also runs the atlas in float64
(the reference), and every figure of every rank must be within twice one float32 process's error from it, plus the
float32 rounding floor; verdicts, the heads gated and the draws must be identical (and float64 must gate the same
heads, or its effects would be another experiment's). tests/test_tensor_parallel_atlas.py's absolute 1e-5, set for
2-layer models, is reported beside it (per-example effects are differences of losses of a 30-layer model, where
float32 alone moves the fifth decimal). The sizes are small so that one process (float32 and float64) and the 3
ranks finish within about 25 minutes on 2 shared cores; the checks stay on with 10 draws.

Writes ``results/tp_smollm2_atlas.json``: per rank and for one process the load and atlas seconds (with the atlas's
own phases), threads and peak RSS, and the comparison.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time

import torch

from _common import RESULTS, write_json

SAVED = RESULTS / "tp_smollm2_atlas_tmp.json"
ONE = RESULTS / "tp_smollm2_atlas_one_tmp.json"
KINDS = ["previous_token", "induction"]
# bench_atlas.py's repeated inputs for SmolLM2 (6 sequences of 2 x 32 random tokens), scored once; then each kind's
# check gates its top 10 heads and 10 random draws of 10 heads (23 configurations x 6 sequences, batched forwards)
SETTINGS = dict(kinds=KINDS, half=32, n_repeated=6, n_draws=10, n_boot=1000, seed=0, copying=True, evidence=True,
                max_rows=32)
ATOL, ATOL_MAPS = 1e-5, 1.1e-3  # tests/test_tensor_parallel_atlas.py's rule (evidence maps are stored to 3 decimals)


def _rss_MiB() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run(lm, t_load: float) -> tuple[dict, dict]:
    """The atlas (JSON, and its raw score grids in full precision) and the row of times and memory."""
    import headlab

    t0, c0 = time.perf_counter(), time.process_time()
    a = headlab.atlas(lm, **SETTINGS)
    row = {"load_s": t_load, "atlas_s": time.perf_counter() - t0, "atlas_cpu_s": time.process_time() - c0,
           "phases_s": a.seconds, "torch_threads": torch.get_num_threads(), "peak_rss_MiB": _rss_MiB(),
           "load_avg_1min": os.getloadavg()[0]}  # the machine is shared: how busy it was at the end
    return {"atlas": a.to_json(), "raw_scores": {k: v.double().tolist() for k, v in a.scores.items()}}, row


def sharded() -> None:
    import torch.distributed as dist

    import headlab

    t0 = time.perf_counter()
    lm = headlab.load("smollm2", tensor_parallel=True)
    got, row = _run(lm, time.perf_counter() - t0)
    row = {"rank": dist.get_rank(), "heads": list(lm.adapter.tp.heads()), **row}
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, {"row": row, **got})
    if row["rank"] == 0:
        SAVED.write_text(json.dumps(everything))
        for x in everything:
            r = x["row"]
            print(f"atlas, rank {r['rank']} (heads {r['heads']}): load {r['load_s']:.1f} s, atlas {r['atlas_s']:.1f} s "
                  f"(phases {r['phases_s']}), peak RSS {r['peak_rss_MiB']:.0f} MiB", flush=True)


def figures(res: dict) -> dict[str, torch.Tensor]:
    """Every number the comparison reads from one atlas, as tensors by name (the rule takes the largest error of
    each, as FlashAttention's takes it over an output): the raw score grids, and per checked kind the per-example
    effects (targeted; each random draw) and the verdict's figures (baseline, targeted mean, its interval, random
    mean)."""
    out = {f"scores.{k}": torch.tensor(v, dtype=torch.float64) for k, v in res["raw_scores"].items()}
    for kind, v in res["atlas"]["verdicts"].items():
        out[f"{kind}.effects_targeted"] = torch.tensor(v["effects"]["targeted"], dtype=torch.float64)
        out[f"{kind}.effects_random"] = torch.tensor(v["effects"]["random"], dtype=torch.float64)
        numbers = [v["baseline"], v["targeted"], *v["targeted_ci"], v["random_mean"]]
        out[f"{kind}.verdict_figures"] = torch.tensor(numbers, dtype=torch.float64)
    return out


def _err(x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest |x - y|; a NaN must sit at the same place on both sides (else inf)."""
    if x.shape != y.shape or not torch.equal(torch.isnan(x), torch.isnan(y)):
        return math.inf
    return float((x - y).abs().nan_to_num(0).max()) if x.numel() else 0.0


def exact_fields(got: dict, ref: dict) -> dict[str, bool]:
    """What must be identical: the kinds, labels and skips, and per check the heads gated, the random draws, the
    number of examples and the verdict; the evidence maps' keys."""
    ga, ra = got["atlas"], ref["atlas"]
    out = {"score_kinds": sorted(got["raw_scores"]) == sorted(ref["raw_scores"]),
           "labels": ga["labels"] == ra["labels"],
           "skipped": ga["skipped"] == ra["skipped"], "checked_kinds": sorted(ga["verdicts"]) == sorted(ra["verdicts"]),
           "evidence_keys": sorted(ga["evidence"]) == sorted(ra["evidence"])}
    for kind, v in ra["verdicts"].items():
        w = ga["verdicts"].get(kind, {})
        for f in ("verdict", "heads", "draws", "n_examples"):
            out[f"{kind}.{f}"] = w.get(f) == v[f]
    return out


def compare(got: dict, one32: dict, one64: dict) -> dict:
    """One rank's atlas against one process's, in float32, under FlashAttention's rule (as tests/test_distributed.py
    applies it): for every figure, ``|rank - one64| <= 2 |one32 - one64| + 2 |(one64 + 0.3 - 0.3)_f32 - one64|``,
    the float64 atlas being the reference and one process's float32 error the yardstick. Also the plain
    ``|rank - one32|`` of each figure and tests/test_tensor_parallel_atlas.py's absolute 1e-5 beside it."""
    g, r32, r64 = figures(got), figures(one32), figures(one64)
    diff, rule = {}, {}
    for name, ref in r64.items():
        err, yard = _err(g[name], ref), _err(r32[name], ref)
        floor = 2 * _err((ref.float() + 0.3 - 0.3).double(), ref)
        diff[name] = _err(g[name], r32[name])
        rule[name] = {"err": err, "yardstick": yard, "floor": floor, "holds": err <= 2 * yard + floor}
    maps = max((_err(torch.tensor(got["atlas"]["evidence"][k]["map"], dtype=torch.float64),
                     torch.tensor(one32["atlas"]["evidence"][k]["map"], dtype=torch.float64))
                for k in one32["atlas"]["evidence"] if k in got["atlas"]["evidence"]), default=0.0)
    exact = exact_fields(got, one32)
    return {"exact": exact, "largest_difference": diff, "flash_rule": rule, "evidence_maps": maps,
            "within_atol_1e-5": all(exact.values()) and max(diff.values()) <= ATOL and maps <= ATOL_MAPS,
            "within_flash_rule": all(exact.values()) and all(x["holds"] for x in rule.values()) and maps <= ATOL_MAPS}


def one() -> None:
    import headlab

    ranks = json.loads(SAVED.read_text())
    t0 = time.perf_counter()
    lm = headlab.load("smollm2")
    one32, row = _run(lm, time.perf_counter() - t0)
    del lm
    t0 = time.perf_counter()
    one64, row64 = _run(headlab.load("smollm2", dtype=torch.float64), time.perf_counter() - t0)  # the reference
    row64.pop("peak_rss_MiB")  # the process's peak, float32's run included: not the float64 run's own
    ONE.write_text(json.dumps({"float32": one32, "float64": one64}))  # kept (ignored by git) to re-read the comparison
    same64 = exact_fields(one64, one32)  # float64 must gate the same heads, or its effects are another experiment's
    per_rank = {x["row"]["rank"]: compare(x, one32, one64) for x in ranks}
    worst = {name: max(c["largest_difference"][name] for c in per_rank.values()) for name in figures(one32)}
    worst_rule = {name: {"err": max(c["flash_rule"][name]["err"] for c in per_rank.values()),
                         "bound": 2 * per_rank[0]["flash_rule"][name]["yardstick"]
                         + per_rank[0]["flash_rule"][name]["floor"]}
                  for name in figures(one32)}
    verdicts = {kind: {"one_process": v["verdict"], "float64": one64["atlas"]["verdicts"][kind]["verdict"],
                       "ranks": [x["atlas"]["verdicts"][kind]["verdict"] for x in ranks],
                       "targeted": v["targeted"], "targeted_ci": v["targeted_ci"], "random_mean": v["random_mean"],
                       "times_random": v.get("times_random"), "n_examples": v["n_examples"], "heads": v["heads"],
                       "ranks_gate_the_same_heads_and_draws": all(
                           c["exact"][f"{kind}.heads"] and c["exact"][f"{kind}.draws"] for c in per_rank.values())}
                for kind, v in one32["atlas"]["verdicts"].items()}
    flash = all(c["within_flash_rule"] for c in per_rank.values()) and all(same64.values())
    atol = all(c["within_atol_1e-5"] for c in per_rank.values())
    print(f"atlas, one process: load {row['load_s']:.1f} s, atlas {row['atlas_s']:.1f} s (phases {row['phases_s']}), "
          f"peak RSS {row['peak_rss_MiB']:.0f} MiB; float64 reference: atlas {row64['atlas_s']:.1f} s")
    print("largest |sharded - one| over the ranks: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    print("verdicts: " + ", ".join(f"{k} {v['one_process']} (ranks {v['ranks']}, float64 {v['float64']})"
                                   for k, v in verdicts.items()))
    print(f"every rank within FlashAttention's rule against the float64 atlas (exact fields identical): {flash}; "
          f"within absolute {ATOL}: {atol}")
    write_json("tp_smollm2_atlas", {
        "world": len(ranks), "settings": dict(SETTINGS),
        "rule": {"flash": "|rank - one64| <= 2 |one32 - one64| + 2 |(one64 + 0.3 - 0.3) in float32 - one64| for "
                          "every figure (the float64 one-process atlas as reference)",
                 "atol": ATOL, "atol_evidence_maps": ATOL_MAPS,
                 "exact": "kinds, labels, skipped, heads gated, draws, n_examples, verdicts, evidence keys"},
        "ranks": [x["row"] for x in ranks], "one_process": row, "float64_reference": row64, "verdicts": verdicts,
        "largest_difference": worst, "flash_rule_worst_rank": worst_rule, "float64_gates_the_same_heads": same64,
        "within_flash_rule": flash, "within_atol_1e-5": atol, "per_rank": per_rank,
        "summary": one32["atlas"]["summary"]})
