"""Run every benchmark in turn (``make bench``); each prints its table and writes benchmarks/results/*.json.

    .venv/bin/python benchmarks/run_all.py            # the full set (about 30-40 minutes on 2 cores)
    .venv/bin/python benchmarks/run_all.py --quick    # short lengths only, a few minutes

Run on a quiet machine: every figure is a ratio to torch SDPA measured in the same run, but other
load still adds noise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (script, full arguments, quick arguments); quick runs write *_tmp.json (ignored by git), so they never
# replace the committed full results
_TMP = HERE / "results"
BENCHMARKS = [
    ("bench_attention.py", [], ["--seq-lens", "1024,2048", "--repeats", "3", "--name", "bench_attention_tmp"]),
    ("bench_tiled_memory.py", ["--seq-lens", "4096,16384"], ["--seq-lens", "4096", "--name", "bench_tiled_memory_tmp"]),
    ("bench_sparse.py", [], ["--lengths", "1024,2048,4096", "--reps", "3", "--out", str(_TMP / "sparse_tmp.json")]),
    ("bench_linear.py", [], ["--lengths", "1024,2048,4096", "--repeats", "3", "--out", str(_TMP / "linear_tmp.json")]),
    ("bench_seed_stats.py", [], ["--layers", "2", "--compare-layers", "1", "--json", str(_TMP / "seed_stats_tmp.json")]),
    ("bench_kernels.py", [], ["--reps", "3", "--sparse-lengths", "4096", "--tiled-lengths", "1024,2048",
                              "--name", "kernels_tmp"]),
    ("bench_ring.py", [], ["--seq-lens", "4096", "--repeats", "1", "--name", "ring_tmp"]),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short lengths only")
    ap.add_argument("--only", default="", help="comma-separated script names to run")
    args = ap.parse_args()
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    failed = []
    for script, full, quick in BENCHMARKS:
        if only and script not in only and script.removesuffix(".py") not in only:
            continue
        cmd = [sys.executable, str(HERE / script), *(quick if args.quick else full)]
        print(f"\n=== {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd)
        print(f"=== {script}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(script)
    _kernel_table(HERE / "results" / ("kernels_tmp.json" if args.quick else "kernels.json"))
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


def _kernel_table(path: Path) -> None:
    """The kernel speed table (bench_kernels.py): each row's ratio to its peer and its goal."""
    if not path.exists():
        return
    import json

    rows = json.loads(path.read_text())["rows"]
    print(f"\nkernel speed ({path.name}; ratio = headlab time / peer time, measured in the same run)")
    print(f"{'row':52s} {'now':>6s}  goal")
    for r in rows:
        print(f"{r['row']:52s} {r['ratio']:6.2f}  {r['goal']}")


if __name__ == "__main__":
    sys.exit(main())
