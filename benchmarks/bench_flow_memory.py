"""Peak memory of rollout rows and streaming norm summaries at 32,768 tokens, each in a fresh process.

    nice -n 5 .venv/bin/python benchmarks/bench_flow_memory.py                 # 32,768 tokens
    nice -n 5 .venv/bin/python benchmarks/bench_flow_memory.py --n 4096        # quick

headlab's own decoder (models/transformer.py ``Transformer``, causal, 4 layers x 4 heads, d_model 128,
random weights) on n random tokens. Each case runs in a child process and reports the child's
resident high-water mark (``ru_maxrss``: Python, torch, the model, the forward, everything):

* ``rollout-rows``: ``headlab.rollout(m, ids, rows=[n-1])``, the last token's rollout row through
  every layer, top-down (``r <- r A_hat_l`` as tiled weighted column sums);
* ``norm-summaries``: ``headlab.attention_norms(m, ids, layers=[-1], stream=True)``, every per-query
  and per-key summary of the last layer's norm maps.

The full rollout would hold ``n_layers * n^2`` float32 values: 16 GiB at 32,768 tokens and 4 layers.
Target (the issue): under 2 GiB. Writes benchmarks/results/flow_memory.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

CASES = ("rollout-rows", "norm-summaries")


def child(case: str, n: int) -> None:
    import torch

    import headlab
    from headlab.models.transformer import Transformer, TransformerConfig

    torch.set_num_threads(2)
    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, causal=True,
                                      max_positions=n, d_ff=512)).eval()
    ids = torch.randint(0, 256, (1, n))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    if case == "rollout-rows":
        r = headlab.rollout(m, ids, rows=[n - 1], backend="sdpa")
        check = float(r.rows.sum())  # a rollout row sums to 1
    else:
        r = headlab.attention_norms(m, ids, layers=[-1], stream=True, backend="sdpa")
        check = float(r.summaries[3].key_weight[..., 0].mean())
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"case": case, "tokens": n, "peak_rss_bytes": peak, "rss_before_bytes": base,
                      "seconds": secs, "check": check}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--child", default=None)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.n)
        return
    rows = []
    full = 4 * args.n * args.n * 4
    print(f"{'case':<16} {'tokens':>7} {'peak RSS':>10} {'seconds':>8}  (full rollout maps: {full / 2**30:.1f} GiB)")
    for case in args.cases.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", case, "--n", str(args.n)], capture_output=True,
                             text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["full_rollout_bytes"] = full
        row["under_2_GiB"] = row["peak_rss_bytes"] < 2 * 2**30
        rows.append(row)
        print(f"{case:<16} {args.n:>7} {row['peak_rss_bytes'] / 2**30:>8.2f} GiB {row['seconds']:>8.1f}", flush=True)
    path = write_json("flow_memory", {"model": "headlab Transformer, causal, 4 layers x 4 heads, d_model 128",
                                      "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
