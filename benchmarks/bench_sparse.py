"""Sparse attention (sliding window) beside torch SDPA (dense), measured in the same run.

    .venv/bin/python benchmarks/bench_sparse.py                      # lengths 512..16384
    .venv/bin/python benchmarks/bench_sparse.py --lengths 1024,4096 --reps 3 --backward
    .venv/bin/python benchmarks/bench_sparse.py --lengths 4096 --no-memory --flex   # beside compiled FlexAttention

Batch 1, 8 heads, head dim 64, float32, sliding window 256 (|i - j| <= 256, non-causal).
Timings are interleaved (SDPA, sparse, SDPA, sparse, ...) and the median of each is kept, so a
shared machine slows both alike; the ratio is what to read. Peak memory is measured in a fresh
subprocess per (length, backend) as the growth of peak RSS over the inputs. Predicted FLOPs come
from ``headlab.costs`` (the block map the kernel walks); measured FLOPs from torch's
FlopCounterMode on the kernel. Writes benchmarks/results/sparse.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import headlab
from headlab import costs, masks

B, H, D, WINDOW = 1, 8, 64, 256
OUT = Path(__file__).resolve().parent / "results" / "sparse.json"


def _inputs(n: int, grad: bool = False):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))  # (B, H, T, D)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def _call(backend: str, q, k, v, mask):
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v)  # dense: the peer to beat
    return headlab.attention(q, k, v, mask=mask, backend="sparse")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_memory(backend: str, n: int) -> int:
    """Peak RSS growth of one forward call, in a fresh process (bytes)."""
    code = f"""
import torch, headlab, torch.nn.functional as F
from headlab import masks
from headlab.spec.blocks import block_map
torch.set_num_threads({torch.get_num_threads()})
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn({B}, {H}, 64, {D}, generator=g) for _ in range(3))
m = masks.sliding_window({WINDOW})
F.scaled_dot_product_attention(q, k, v); headlab.attention(q, k, v, mask=m, backend="sparse")  # warm code paths
q, k, v = (torch.randn({B}, {H}, {n}, {D}, generator=g) for _ in range(3))
block_map(m, {n}, {n}, 128, 128)
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
open('/proc/self/clear_refs', 'w').write('5')  # reset the peak RSS (VmHWM) to the current RSS
base = status('VmRSS:')
if "{backend}" == "sdpa":
    out = F.scaled_dot_product_attention(q, k, v)
else:
    out = headlab.attention(q, k, v, mask=m, backend="sparse")
peak = status('VmHWM:')
print(max(0, peak - base))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(res.stdout.strip().splitlines()[-1])


def run(lengths: list[int], reps: int, backward: bool, memory: bool) -> dict:
    mask = masks.sliding_window(WINDOW)
    rows = []
    for n in lengths:
        q, k, v = _inputs(n)
        _call("sparse", q, k, v, mask)  # builds and caches the plan (block map, partial-tile masks)
        _call("sdpa", q, k, v, mask)
        times = {"sdpa": [], "sparse": []}
        for _ in range(reps):  # interleaved
            for backend in ("sdpa", "sparse"):
                times[backend].append(_timed(lambda: _call(backend, q, k, v, mask)))
        t_sdpa, t_sparse = statistics.median(times["sdpa"]), statistics.median(times["sparse"])
        shape = costs.AttentionShape(batch=B, heads=H, q_len=n, head_dim=D, mask=mask)
        pred_sparse = costs.estimate(shape, "sparse")
        pred_dense = costs.estimate(costs.AttentionShape(batch=B, heads=H, q_len=n, head_dim=D), "sdpa")
        with FlopCounterMode(display=False) as fc:
            _call("sparse", q, k, v, mask)
        row = {
            "seq_len": n,
            "sdpa_fwd_s": t_sdpa, "sparse_fwd_s": t_sparse, "speedup_fwd": t_sdpa / t_sparse,
            "sdpa_fwd_all_s": times["sdpa"], "sparse_fwd_all_s": times["sparse"],
            "predicted_flops_sparse": pred_sparse.forward_flops,
            "measured_flops_sparse": fc.get_total_flops(),
            "predicted_flops_dense": pred_dense.forward_flops,
            "predicted_speedup": pred_dense.forward_flops / pred_sparse.forward_flops,
            "sparse_gflops_per_s": pred_sparse.forward_flops / t_sparse / 1e9,
            "sdpa_gflops_per_s": pred_dense.forward_flops / t_sdpa / 1e9,
            "tile_note": pred_sparse.notes,
        }
        if backward:
            qg, kg, vg = _inputs(n, grad=True)
            tb = {"sdpa": [], "sparse": []}
            for _ in range(max(1, reps // 2)):
                for backend in ("sdpa", "sparse"):
                    def step():
                        out = _call(backend, qg, kg, vg, mask)
                        out.backward(torch.ones_like(out))
                    tb[backend].append(_timed(step))
            row["sdpa_fwd_bwd_s"] = statistics.median(tb["sdpa"])
            row["sparse_fwd_bwd_s"] = statistics.median(tb["sparse"])
            row["speedup_fwd_bwd"] = row["sdpa_fwd_bwd_s"] / row["sparse_fwd_bwd_s"]
        if memory:
            row["sdpa_peak_bytes"] = measure_memory("sdpa", n)
            row["sparse_peak_bytes"] = measure_memory("sparse", n)
            row["sparse_predicted_working_set_bytes"] = pred_sparse.working_set_bytes
        rows.append(row)
        print(_line(row), flush=True)
    crossover = None
    for i, r in enumerate(rows):
        if all(x["speedup_fwd"] > 1 for x in rows[i:]):
            crossover = r["seq_len"]
            break
    return {
        "benchmark": "sparse sliding_window(256) vs dense torch SDPA, forward",
        "config": {"batch": B, "heads": H, "head_dim": D, "dtype": "float32", "window": WINDOW,
                   "block": [headlab.attention.backends.sparse.BLOCK_Q, headlab.attention.backends.sparse.BLOCK_K],
                   "reps": reps, "threads": torch.get_num_threads()},
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "machine": platform.machine(), "cpus": os.cpu_count(),
                        "load_average": os.getloadavg()},
        "rows": rows,
        "crossover_seq_len": crossover,
        "note": "timings interleaved on a possibly shared machine: read the ratios; re-run for final numbers",
    }


def _line(r: dict) -> str:
    s = (f"n={r['seq_len']:>6}  sdpa {r['sdpa_fwd_s'] * 1e3:9.1f} ms  sparse {r['sparse_fwd_s'] * 1e3:8.1f} ms  "
         f"time/sdpa {1 / r['speedup_fwd']:6.3f} (FLOPs/sdpa's {1 / r['predicted_speedup']:6.3f})  "
         f"FLOPs pred {r['predicted_flops_sparse'] / 1e9:7.2f} G / counted {r['measured_flops_sparse'] / 1e9:7.2f} G  "
         f"sparse {r['sparse_gflops_per_s']:5.1f} GFLOP/s vs sdpa {r['sdpa_gflops_per_s']:5.1f}")
    if "speedup_fwd_bwd" in r:
        s += f"  fwd+bwd time/sdpa {1 / r['speedup_fwd_bwd']:.3f}"
    if "sparse_peak_bytes" in r:
        s += f"  peak MiB sdpa {r['sdpa_peak_bytes'] / 2**20:.0f} sparse {r['sparse_peak_bytes'] / 2**20:.0f}"
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--backward", action="store_true", help="also time forward + backward")
    ap.add_argument("--no-memory", action="store_true", help="skip the subprocess memory measurement")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--flex", action="store_true",
                    help="also time torch.compile(flex_attention) with the same masks (sliding window at each "
                         "length; causal window, BigBird, documents at 8,192), in this run: bench_kernels.py's rows")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    result = run(lengths, args.reps, args.backward, not args.no_memory)
    print(f"crossover (sparse faster from here on): {result['crossover_seq_len']}")
    if args.flex:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_kernels import sparse_rows

        result["flex"] = []
        print(f"{'against compiled FlexAttention':52s} {'flex s':>9s} {'sparse s':>9s} {'ratio':>7s}")
        for name, r, goal in sparse_rows(args.reps, [n for n in lengths if n >= 4096] or [4096]):
            result["flex"].append({"row": name, "goal": goal, **r})
            print(f"{name:52s} {r['peer_s']:9.4f} {r['ours_s']:9.4f} {r['ratio']:7.2f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
