"""Linear attention (elu+1, FAVOR+) beside torch SDPA, in the same run: time, memory, crossover.

    .venv/bin/python benchmarks/bench_linear.py                 # lengths 256 .. 16384, writes JSON
    .venv/bin/python benchmarks/bench_linear.py --lengths 1024,2048 --repeats 2

Batch 1, 8 heads, head dim 64, float32, forward pass, CPU. Every length times each variant in
turn, ``--repeats`` times (interleaved, so load on a shared machine hits all alike); the table
reports the best time and the speed-up over SDPA *measured in the same run* (non-causal variants
against non-causal SDPA, causal against causal). Peak memory is the rise of the process's peak
resident set during one call (``/proc/self/clear_refs`` resets it; large allocations are served by
mmap so that freed memory does not hide). Predicted FLOPs and working set come from
``headlab.costs``; achieved GFLOP/s = predicted FLOPs / measured time.

The crossover is the length at which a variant starts to beat SDPA, interpolated in log length
between the two measured lengths around the change of sign of log(speed-up).

Speed is printed as time / sdpa (below 1: faster than SDPA; the JSON keeps ``speedup_vs_sdpa``, its
inverse). Goals at 16,384 tokens: linear non-causal at most 0.05 of SDPA's time, causal linear at most
0.2 of causal SDPA's, memory linear in length.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

import headlab
from headlab import costs
from headlab.attention.backends.linear import LinearBackend
from headlab.costs.linear import linear_cost_for
from headlab.attention.measure import run_with_peak

B, H, D = 1, 8, 64
RESULTS = Path(__file__).resolve().parent / "results" / "linear.json"


def _use_mmap_for_large_allocations() -> None:
    """Large blocks from mmap, returned to the OS on free: the peak RSS then tracks live memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD (fixed: disables glibc's dynamic raise)
        libc.mallopt(-1, 256 * 1024)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def variants():
    elu = LinearBackend("elu")
    favor = LinearBackend("favor", num_features=256, seed=0)
    return [
        # name, causal, fn(q, k, v), predicted cost(shape)
        ("sdpa", False, lambda q, k, v: F.scaled_dot_product_attention(q, k, v), lambda s: costs.estimate(s, "sdpa")),
        ("sdpa causal", True, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         lambda s: costs.estimate(s, "sdpa")),
        ("linear elu", False, lambda q, k, v: headlab.attention(q, k, v, backend=elu),
         lambda s: linear_cost_for(s, elu)),
        ("linear elu causal", True, lambda q, k, v: headlab.attention(q, k, v, causal=True, backend=elu),
         lambda s: linear_cost_for(s, elu)),
        ("favor:256", False, lambda q, k, v: headlab.attention(q, k, v, backend=favor),
         lambda s: linear_cost_for(s, favor)),
        ("favor:256 causal", True, lambda q, k, v: headlab.attention(q, k, v, causal=True, backend=favor),
         lambda s: linear_cost_for(s, favor)),
    ]


def crossover(lengths: list[int], speedups: list[float]) -> dict:
    """Where log(speed-up) changes sign from < 0 to >= 0 for good, interpolated in log length."""
    logs = [math.log(s) for s in speedups]
    if all(x >= 0 for x in logs):
        return {"length": None, "note": f"faster than SDPA at every measured length (from {lengths[0]})"}
    if logs[-1] < 0:
        return {"length": None, "note": f"slower than SDPA at every length up to {lengths[-1]}"}
    i = max(j for j, x in enumerate(logs) if x < 0)  # last loss; everything after it wins
    a, b = math.log(lengths[i]), math.log(lengths[i + 1])
    t = -logs[i] / (logs[i + 1] - logs[i])
    return {"length": round(math.exp(a + t * (b - a))), "between": [lengths[i], lengths[i + 1]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="256,512,1024,2048,4096,8192,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    _use_mmap_for_large_allocations()
    lengths = [int(x) for x in args.lengths.split(",")]
    vs = variants()
    rows = []
    torch.manual_seed(0)
    print(f"B={B} H={H} d={D} float32, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'length':>7} {'variant':<18} {'best ms':>10} {'time/sdpa':>9} {'peak MiB':>9} {'pred MiB':>9} "
          f"{'GFLOP':>8} {'GFLOP/s':>8}")
    for n in lengths:
        q, k, v = (torch.randn(B, H, n, D) for _ in range(3))
        for _, _, fn, _ in vs:  # warm-up (features drawn, threads spun up)
            if n <= 1024:
                fn(q, k, v)
        times = {name: [] for name, *_ in vs}
        peaks = {name: None for name, *_ in vs}
        for rep in range(args.repeats):
            for name, _, fn, _ in vs:
                dt, peak = run_with_peak(lambda: fn(q, k, v))
                times[name].append(dt)
                if rep == 0:
                    peaks[name] = peak
        for name, causal, _, cost_fn in vs:
            shape = costs.AttentionShape(batch=B, heads=H, q_len=n, head_dim=D, causal=causal)
            c = cost_fn(shape)
            best = min(times[name])
            peer = "sdpa causal" if causal else "sdpa"
            speedup = min(times[peer]) / best
            row = {
                "length": n, "variant": name, "causal": causal, "times_s": times[name], "best_s": best,
                "speedup_vs_sdpa": speedup, "peak_bytes": peaks[name],
                "predicted_working_set_bytes": c.working_set_bytes, "predicted_forward_flops": c.forward_flops,
                "achieved_gflops": c.forward_flops / best / 1e9,
            }
            rows.append(row)
            pk = "n/a" if peaks[name] is None else f"{peaks[name] / 2**20:9.1f}"
            print(f"{n:>7} {name:<18} {best * 1e3:>10.1f} {1 / speedup:>9.3f} {pk:>9} "
                  f"{c.working_set_bytes / 2**20:>9.1f} {c.forward_flops / 1e9:>8.2f} {row['achieved_gflops']:>8.2f}")
        del q, k, v

    summary = {"crossover": {}, "memory_growth_last_doubling": {}, "targets": {}}
    for name, causal, *_ in vs:
        if name.startswith("sdpa"):
            continue
        mine = [r for r in rows if r["variant"] == name]
        summary["crossover"][name] = crossover([r["length"] for r in mine], [r["speedup_vs_sdpa"] for r in mine])
        pk = [r["peak_bytes"] for r in mine]
        if len(mine) >= 2 and pk[-1] and pk[-2] and mine[-1]["length"] == 2 * mine[-2]["length"]:
            summary["memory_growth_last_doubling"][name] = pk[-1] / pk[-2]
    at = {r["variant"]: r for r in rows if r["length"] == 16384}
    if at:
        summary["targets"] = {
            "linear non-causal >= 20x SDPA at 16384": {"measured": at["linear elu"]["speedup_vs_sdpa"],
                                                        "met": at["linear elu"]["speedup_vs_sdpa"] >= 20},
            "causal linear >= 5x causal SDPA at 16384": {"measured": at["linear elu causal"]["speedup_vs_sdpa"],
                                                          "met": at["linear elu causal"]["speedup_vs_sdpa"] >= 5},
        }
    print("\ncrossover (length at which the variant starts to beat SDPA):")
    for name, cx in summary["crossover"].items():
        print(f"  {name:<18} {cx.get('length') or '-':>7}  {cx.get('note', '')}")
    if summary["memory_growth_last_doubling"]:
        print("peak memory growth over the last length doubling (2.0 = linear):")
        for name, g in summary["memory_growth_last_doubling"].items():
            print(f"  {name:<18} {g:.2f}")
    for t, val in summary["targets"].items():
        print(f"target: {t}: measured {val['measured']:.1f}x -> {'met' if val['met'] else 'NOT met'}")

    result = {
        "benchmark": "linear", "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "load_average_1min": os.getloadavg()[0]},
        "shape": {"batch": B, "heads": H, "head_dim": D, "dtype": "float32", "pass": "forward"},
        "repeats": args.repeats, "rows": rows, "summary": summary,
        "note": "shared machine: compare speed-ups measured in the same run, not absolute times",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
