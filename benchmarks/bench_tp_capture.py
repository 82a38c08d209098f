"""Capture on SmolLM2-135M sharded by tensor parallelism, against one process (issue 32, first part).

SmolLM2 has 9 query heads on 3 kv heads: transformers' plan needs a world size that divides both, so 3 ranks.
Under torchrun each rank loads its shard (``headlab.load("smollm2", tensor_parallel=True)``), captures the
patterns and z of every layer on one sentence and reports its parameters, load and capture time and peak RSS;
rank 0 saves the gathered sites. Then one process (the peer, same sentence) captures the same sites and prints
the largest difference from the sharded result.

    .venv/bin/torchrun --nproc_per_node 3 benchmarks/bench_tp_capture.py   # the sharded run (gloo, CPU)
    .venv/bin/python benchmarks/bench_tp_capture.py --one                  # one process, and the comparison

Writes ``benchmarks/results/tp_capture.json`` (the second command adds the comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, write_json  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog because it was late for dinner."
SITES = ["blocks.*.attn.pattern", "blocks.*.attn.z"]
SAVED = RESULTS / "tp_capture_sites.pt"


def _numel(p) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _row(lm, t_load: float, t_cap: float) -> dict:
    named = list(lm.model.named_parameters())
    return {"params_M": sum(_numel(p) for _, p in named) / 1e6,
            "attention_params_M": sum(_numel(p) for n, p in named if "self_attn" in n) / 1e6,
            "load_s": t_load, "capture_s": t_cap,
            "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def sharded() -> None:
    import torch.distributed as dist

    import headlab

    rank = int(os.environ["RANK"])
    t0 = time.perf_counter()
    lm = headlab.load("smollm2", tensor_parallel=True)
    t_load = time.perf_counter() - t0
    ids = lm.encode(TEXT)
    t1 = time.perf_counter()
    cache = headlab.capture(lm, ids, SITES)
    row = {"rank": rank, "heads": list(lm.adapter.tp.heads()), **_row(lm, t_load, time.perf_counter() - t1)}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        SAVED.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: cache[k] for k in cache.keys()}, SAVED)
        for r in rows:
            print(f"rank {r['rank']}: heads {r['heads']}, {r['params_M']:.1f}M parameters ({r['attention_params_M']:.2f}M "
                  f"attention), load {r['load_s']:.1f} s, capture {r['capture_s']:.2f} s, peak RSS {r['peak_rss_MiB']:.0f} MiB")
        write_json("tp_capture", {"world": dist.get_world_size(), "text": TEXT, "sites": SITES, "ranks": rows})


def one() -> None:
    import headlab

    t0 = time.perf_counter()
    lm = headlab.load("smollm2")
    t_load = time.perf_counter() - t0
    ids = lm.encode(TEXT)
    t1 = time.perf_counter()
    cache = headlab.capture(lm, ids, SITES)
    row = _row(lm, t_load, time.perf_counter() - t1)
    tp = torch.load(SAVED)
    worst = {k: float((cache[k] - tp[k]).abs().max()) for k in tp}
    kind = {s: max(v for k, v in worst.items() if k.endswith(s)) for s in ("pattern", "z")}
    print(f"one process: {row['params_M']:.1f}M parameters ({row['attention_params_M']:.2f}M attention), capture "
          f"{row['capture_s']:.2f} s, peak RSS {row['peak_rss_MiB']:.0f} MiB; largest |sharded - one| over {len(tp)} "
          f"sites: pattern {kind['pattern']:.1e}, z {kind['z']:.1e}")
    doc = json.loads((RESULTS / "tp_capture.json").read_text())
    doc.pop("machine", None)
    write_json("tp_capture", {**doc, "one_process": row, "largest_difference": kind})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", action="store_true", help="the one-process peer and the comparison")
    one() if ap.parse_args().one else sharded()
