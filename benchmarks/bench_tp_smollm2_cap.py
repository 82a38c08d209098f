"""The ``cap`` part of ``bench_tp_smollm2.py``: a memory cap that one process exceeds and 3 tensor-parallel ranks fit
(issue 32's done-when).

headlab's memory guard reads what is available from ``HEADLAB_MEMORY_LIMIT`` when it is set
(:func:`headlab.spec.memory_guard.available_memory`), and ``headlab.load`` checks the parameters' bytes against 90%
of it before reading a weight: one process's bytes, or under ``tensor_parallel=True`` this rank's share from the
family's plan (:func:`headlab.costs.tensor_parallel.weight_bytes`). SmolLM2-135M in float32 needs 513 MiB in one
process and 171 MiB per rank over 3, so a cap of :data:`CAP` (0.9 x 384 = 346 MiB) lies between:

- under torchrun every rank sets the cap, loads its shard and captures the map-free statistics of every head on
  ``bench_tp_smollm2.TEXT`` (what ``headlab analyze`` tabulates); rank 0 keeps them in
  ``results/tp_smollm2_cap_tmp.json`` (ignored by git) with each rank's row;
- one process sets the same cap and must be refused by ``headlab.load`` with a ``MemoryBudgetError`` carrying the
  estimate, before the weights are read (its resident size barely moves); then, without the cap, it loads the model,
  captures the same statistics and compares them with the sharded run's.

Each estimate is checked against an independent count: the bytes of the parameters each side actually holds after
loading (a rank's DTensor shards count their local part). The cap is the guard's notion of available memory; it
bounds the weights headlab predicts, not the process's resident size (the interpreter, torch, transformers and gloo
come on top, and the ranks' peak RSS is given beside one process's).

Writes ``results/tp_smollm2_cap.json``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from contextlib import contextmanager

import torch

from _common import RESULTS, write_json

CAP = "384MiB"
SAVED = RESULTS / "tp_smollm2_cap_tmp.json"
# the statistics reach 16 (lse, mean distance, mass received on 16 tokens), where a float32 step is 2e-6: 1e-4 is 6e-6
# of the largest entry, float32 agreement after 30 layers computed in another order (the analyze part saw 2.2e-5)
ATOL = 1e-4


@contextmanager
def limit(value: str):
    """``HEADLAB_MEMORY_LIMIT=value`` inside the block, the previous setting (or none) after it."""
    old = os.environ.get("HEADLAB_MEMORY_LIMIT")
    os.environ["HEADLAB_MEMORY_LIMIT"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HEADLAB_MEMORY_LIMIT")
        else:
            os.environ["HEADLAB_MEMORY_LIMIT"] = old


def _rss_now_MiB() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return math.nan


def _peak_MiB() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def held_bytes(lm) -> int:
    """The parameters' bytes this process holds (a DTensor's local shard; a tied weight once)."""
    total = 0
    for _, p in lm.model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def guard_estimate(world: int) -> int:
    """The bytes the loader's guard checks for SmolLM2 on this rank (``world`` ranks) or one process (``world=1``):
    its own check run against a 1-byte limit, which refuses and reports the estimate. Private by intent: the figure
    is the one the guard compared with the cap, not a recomputation that could drift from it."""
    import transformers
    from transformers import AutoConfig

    from headlab.errors import MemoryBudgetError
    from headlab.models.loader import _check_weights_fit
    from headlab.models.named_models import KNOWN_MODELS

    path = KNOWN_MODELS["smollm2"]()
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    cls = getattr(transformers, config.architectures[0])
    try:
        with limit("1"):
            _check_weights_fit(cls, config, "smollm2", dtype=torch.float32, device="cpu", world=world)
    except MemoryBudgetError as e:
        return int(e.estimate_bytes)
    raise RuntimeError("the guard accepted 1 byte: it did not check the weights")


def statistics(lm) -> tuple[dict, float]:
    import headlab
    from bench_tp_smollm2 import TEXT

    t = time.perf_counter()
    st = headlab.capture(lm, lm.encode(TEXT), ["blocks.*.attn.stats"])
    figs = {f"{k}.{f}": v for k, s in st.items() for f, v in s.as_dict().items() if torch.is_tensor(v)}
    return figs, time.perf_counter() - t


def sharded(cap: str = CAP) -> None:
    import torch.distributed as dist

    import headlab
    from headlab.units import parse_bytes

    with limit(cap):
        t0 = time.perf_counter()
        lm = headlab.load("smollm2", tensor_parallel=True)  # the guard checks this rank's share against the cap
        t_load = time.perf_counter() - t0
        figs, t_stats = statistics(lm)
    world = dist.get_world_size()
    row = {"rank": dist.get_rank(), "heads": list(lm.adapter.tp.heads()), "loaded_under_cap": True,
           "guard_estimate_bytes": guard_estimate(world), "held_bytes": held_bytes(lm),
           "cap_bytes": parse_bytes(cap), "load_s": t_load, "statistics_s": t_stats,
           "torch_threads": torch.get_num_threads(), "peak_rss_MiB": _peak_MiB(), "load_avg_1min": os.getloadavg()[0]}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if row["rank"] == 0:
        stats = {k: v.double().tolist() for k, v in figs.items()}
        SAVED.write_text(json.dumps({"cap": cap, "ranks": rows, "stats": stats}))
        for r in rows:
            print(f"cap {cap}: rank {r['rank']} loaded (guard estimate {r['guard_estimate_bytes'] / 2**20:.1f} MiB, "
                  f"holds {r['held_bytes'] / 2**20:.1f} MiB), statistics {r['statistics_s']:.2f} s, "
                  f"peak RSS {r['peak_rss_MiB']:.0f} MiB", flush=True)


def _max_diff(a, b) -> float:
    x, y = torch.tensor(a, dtype=torch.float64), torch.as_tensor(b).double()
    if x.shape != y.shape or not torch.equal(torch.isnan(x), torch.isnan(y)):
        return math.inf
    return float((x - y).abs().nan_to_num(0).max()) if x.numel() else 0.0


def one(cap: str = CAP) -> None:
    import transformers  # noqa: F401  (imported before the refusal, so its resident size is not counted there)

    import headlab
    from headlab.errors import MemoryBudgetError
    from headlab.spec.memory_guard import HEADROOM
    from headlab.units import parse_bytes

    got = json.loads(SAVED.read_text())
    tries = []
    for _ in range(2):  # the first attempt also imports the family's modules; the second shows the refusal alone
        rss0 = _rss_now_MiB()
        try:
            with limit(cap):
                headlab.load("smollm2")
            raise SystemExit(f"one process loaded SmolLM2 under HEADLAB_MEMORY_LIMIT={cap}: the cap is not below "
                             "its need")
        except MemoryBudgetError as e:
            tries.append({"error": type(e).__name__, "message": str(e), "estimate_bytes": e.estimate_bytes,
                          "available_bytes": e.available_bytes, "rss_before_MiB": rss0,
                          "rss_after_MiB": _rss_now_MiB()})
    refused = {k: tries[0][k] for k in ("error", "message", "estimate_bytes", "available_bytes")}
    refused.update({"rss_first_try_MiB": [tries[0]["rss_before_MiB"], tries[0]["rss_after_MiB"]],
                    "rss_second_try_MiB": [tries[1]["rss_before_MiB"], tries[1]["rss_after_MiB"]],
                    "same_refusal_twice": tries[1]["message"] == tries[0]["message"]})
    t0 = time.perf_counter()
    lm = headlab.load("smollm2")  # without the cap: the peer of the sharded statistics
    t_load = time.perf_counter() - t0
    figs, t_stats = statistics(lm)
    held = held_bytes(lm)
    worst = max(_max_diff(got["stats"][k], v) for k, v in figs.items())
    same_keys = sorted(got["stats"]) == sorted(figs)
    row = {"refused": refused, "held_bytes": held, "load_s": t_load, "statistics_s": t_stats,
           "torch_threads": torch.get_num_threads(), "peak_rss_MiB": _peak_MiB()}
    ranks = got["ranks"]
    checks = {"one_process_estimate_equals_held_bytes": refused["estimate_bytes"] == held,
              "rank_estimates_equal_held_bytes": all(r["guard_estimate_bytes"] == r["held_bytes"] for r in ranks),
              "rank_shares_add_up_to_one_process": sum(r["held_bytes"] for r in ranks) >= held,
              "one_process_over_cap": refused["estimate_bytes"] > HEADROOM * parse_bytes(cap),
              "every_rank_under_cap": all(r["guard_estimate_bytes"] <= HEADROOM * parse_bytes(cap) for r in ranks),
              # the weights would add 513 MiB; a refusal before reading them adds next to nothing once imports are done
              "refused_before_allocating": tries[1]["rss_after_MiB"] - tries[1]["rss_before_MiB"] < held / 2**20 / 20,
              "statistics_same_fields": same_keys, "statistics_within_atol": same_keys and worst <= ATOL}
    print(f"cap {cap}: one process refused: {refused['message']} (resident {tries[0]['rss_before_MiB']:.0f} -> "
          f"{tries[0]['rss_after_MiB']:.0f} MiB on the first try, with the imports; "
          f"{tries[1]['rss_before_MiB']:.0f} -> {tries[1]['rss_after_MiB']:.0f} MiB on the second); "
          f"{len(ranks)} ranks loaded and ran the statistics; largest |sharded - one| {worst:.1e}")
    print("checks: " + ", ".join(f"{k} {v}" for k, v in checks.items()))
    write_json("tp_smollm2_cap", {"cap": cap, "cap_bytes": parse_bytes(cap), "headroom": HEADROOM, "world": len(ranks),
                                  "ranks": ranks, "one_process": row, "statistics_largest_difference": worst,
                                  "atol": ATOL, "checks": checks})
