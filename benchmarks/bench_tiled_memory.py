"""Peak memory of the ``tiled`` backend, forward + backward, in a fresh process per length.

    .venv/bin/python benchmarks/bench_tiled_memory.py                      # 16,384 tokens (the issue's check)
    .venv/bin/python benchmarks/bench_tiled_memory.py --seq-lens 2048,4096,8192,16384

Batch 1, 8 heads, head dim 64, float32. "Peak extra" is the child's resident high-water mark
minus its resident size after q, k, v and the output gradient were allocated (and one tiny
warm-up call made), so it counts the output, lse, dq/dk/dv and every temporary. The issue's
bound: under 5% of the 8 GiB that the materialised 16,384 x 16,384 x 8 float32 weights take.
The cost model's predicted working set is printed beside it.
Writes benchmarks/results/bench_tiled_memory.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

from headlab.attention.backends.tiled import working_set_bytes  # noqa: E402
from headlab.units import human_bytes  # noqa: E402
from headlab.spec.attention_spec import AttentionSpec  # noqa: E402
from headlab.attention.measure import _mem_run, _mem_setup, peak_memory_growth  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default="16384")
    ap.add_argument("--backend", default="tiled")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--name", default="bench_tiled_memory", help="results/<name>.json")
    args = ap.parse_args(argv)
    B, H, D = 1, 8, 64
    rows = []
    print(f"{args.backend}, forward + backward, batch {B}, {H} heads, head dim {D}, float32"
          f"{', causal' if args.causal else ''}")
    print(f"{'L':>6} {'peak extra':>11} {'predicted':>10} {'weights map':>12} {'share':>7} {'seconds':>8}")
    for L in (int(x) for x in args.seq_lens.split(",")):
        cfg = {"seq_len": L, "batch": B, "heads": H, "head_dim": D, "dtype": torch.float32,
               "causal": args.causal, "backward": True, "mask": None, "seed": 0}
        t0 = time.perf_counter()
        grew = peak_memory_growth(_mem_run, cfg, args.backend, setup=_mem_setup)
        secs = time.perf_counter() - t0
        spec = AttentionSpec(batch=B, heads=H, kv_heads=H, q_len=L, kv_len=L, head_dim=D, v_dim=D,
                             dtype=torch.float32, device=torch.device("cpu"), causal=args.causal, requires_grad=True)
        predicted = working_set_bytes(spec, backward=True)
        # what the backward's autograd also holds: the output and the grads dq, dk, dv it returns
        weights = B * H * L * L * 4
        row = {"seq_len": L, "peak_extra_bytes": grew, "predicted_working_set_bytes": predicted,
               "materialized_weights_bytes": weights, "share_of_weights": grew / weights, "seconds": secs}
        rows.append(row)
        print(f"{L:>6} {human_bytes(grew):>11} {human_bytes(predicted):>10} {human_bytes(weights):>12} "
              f"{100 * grew / weights:>6.2f}% {secs:>8.1f}", flush=True)
    path = write_json(args.name, {"backend": args.backend, "causal": args.causal, "rows": rows,
                                              "bound": "peak extra < 5% of the materialised weights"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
