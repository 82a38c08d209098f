"""Speed of the ``tiled`` backend as a ratio to torch's SDPA, timed in the same run, interleaved.

    .venv/bin/python benchmarks/bench_attention.py                    # 1k..16k, causal and not, fwd and fwd+bwd
    .venv/bin/python benchmarks/bench_attention.py --seq-lens 4096 --sweep   # try tile shapes

Batch 1, 8 heads, head dim 64, float32 (the issue's setting). Each round times SDPA and every
tiled configuration once, in turn, so that load from other processes hits all of them alike;
the table reports the median over rounds and the median of the per-round ratios.
Speed is time / sdpa (below 1: faster than SDPA). Goal: forward <= 1.5 from 4,096 tokens up,
forward+backward <= 2.
Writes benchmarks/results/bench_attention.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

from headlab.attention.backends.tiled import BLOCK_K, BLOCK_Q, tiled_attention  # noqa: E402

SWEEP = [(128, 512), (256, 256), (256, 512), (256, 1024), (512, 512), (512, 256), (1024, 512)]


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _tiled(bq, bk):
    def fn(q, k, v, causal):
        return tiled_attention(q, k, v, causal=causal, block_q=bq, block_k=bk)
    return fn


def _once(fn, q, k, v, causal, grad_out) -> float:
    t0 = time.perf_counter()
    out = fn(q, k, v, causal)
    if grad_out is not None:
        out.backward(grad_out)
        q.grad = k.grad = v.grad = None
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--sweep", action="store_true", help="also time the tile shapes in SWEEP")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--causal", default="false,true")
    ap.add_argument("--name", default="bench_attention", help="results/<name>.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lens = [int(x) for x in args.seq_lens.split(",")]
    configs = {"sdpa": _sdpa, f"tiled {BLOCK_Q}x{BLOCK_K}": _tiled(BLOCK_Q, BLOCK_K)}
    if args.sweep:
        for bq, bk in SWEEP:
            configs.setdefault(f"tiled {bq}x{bk}", _tiled(bq, bk))
    B, H, D = 1, 8, 64
    rows = []
    print(f"batch {B}, {H} heads, head dim {D}, float32, torch threads {torch.get_num_threads()}, "
          f"{args.repeats} interleaved rounds (+1 warm-up)")
    print(f"{'L':>6} {'causal':>6} {'mode':>8} {'config':>16} {'median ms':>10} {'time/sdpa':>9} {'min times':>9}")
    print("(time/sdpa: median of the per-round time / sdpa; min times: fastest time / fastest sdpa time)")
    for L in lens:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, generator=gen) for _ in range(3))
        for mode in args.modes.split(","):
            bwd = mode == "fwd+bwd"
            for t in (q, k, v):
                t.requires_grad_(bwd)
            g = torch.randn(B, H, L, D, generator=gen) if bwd else None
            for causal in (c == "true" for c in args.causal.split(",")):
                times = {name: [] for name in configs}
                for rnd in range(args.repeats + 1):
                    for name, fn in configs.items():
                        dt = _once(fn, q, k, v, causal, g)
                        if rnd:
                            times[name].append(dt)
                sd = times["sdpa"]
                for name, ts in times.items():
                    ratios = [a / b for a, b in zip(ts, sd)]
                    row = {"seq_len": L, "causal": causal, "mode": mode, "config": name,
                           "median_s": statistics.median(ts), "min_s": min(ts),
                           "ratio_median": statistics.median(ratios), "ratio_of_mins": min(ts) / min(sd)}
                    rows.append(row)
                    print(f"{L:>6} {str(causal):>6} {mode:>8} {name:>16} {row['median_s'] * 1e3:>10.1f} "
                          f"{row['ratio_median']:>9.2f} {row['ratio_of_mins']:>9.2f}", flush=True)
    path = write_json(args.name, {"batch": B, "heads": H, "head_dim": D, "dtype": "float32",
                                  "repeats": args.repeats, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
