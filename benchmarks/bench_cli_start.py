"""How fast and how small the command line starts: ``headlab --help``, ``headlab memory`` and a refusal, each in a
fresh process, against bare ``python -c "import torch"`` and ``import transformers`` timed in the same run.

    .venv/bin/python benchmarks/bench_cli_start.py            # 5 rounds, interleaved; writes results/cli_start.json
    .venv/bin/python benchmarks/bench_cli_start.py --rounds 9

Run it on an idle machine: wall time is the median of the rounds, memory the largest peak resident set (the
child's ``ru_maxrss`` from ``os.wait4``). ``imports`` says whether the command imported torch / transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADLAB = Path(sys.executable).with_name("headlab")

PROBE = ("import sys, runpy; sys.argv = ['headlab', *{argv!r}]\n"
         "try:\n    runpy.run_module('headlab', run_name='__main__')\nexcept SystemExit:\n    pass\n"
         "print('IMPORTS', 'torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)")

CASES = {
    "headlab --help": [str(HEADLAB), "--help"],
    "headlab memory --seq-len 1000000000000 --causal": [str(HEADLAB), "memory", "--seq-len", "1000000000000", "--causal"],
    "headlab flow --top 0 (a refusal)": [str(HEADLAB), "flow", "the cat", "--top", "0"],
    "python -c 'import torch' (peer)": [sys.executable, "-c", "import torch"],
    "python -c 'import transformers' (peer)": [sys.executable, "-c", "import transformers"],
}


def _once(cmd: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss * 1024  # Linux: KiB


def _imports(argv: list[str]) -> tuple[bool, bool]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True)
    line = [ln for ln in done.stderr.splitlines() if ln.startswith("IMPORTS")][-1].split()
    return line[1] == "True", line[2] == "True"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "cli_start.json")
    args = ap.parse_args()
    walls = {k: [] for k in CASES}
    peaks = {k: [] for k in CASES}
    for _ in range(args.rounds):  # interleaved, so load drifts hit every case alike
        for name, cmd in CASES.items():
            w, m = _once(cmd)
            walls[name].append(w)
            peaks[name].append(m)
    torch_s = statistics.median(walls["python -c 'import torch' (peer)"])
    rows = []
    for name, cmd in CASES.items():
        torch_in, tf_in = _imports(cmd[1:]) if cmd[0] == str(HEADLAB) else (None, None)
        rows.append({"command": name, "median_s": statistics.median(walls[name]), "min_s": min(walls[name]),
                     "peak_bytes": max(peaks[name]), "vs_import_torch": statistics.median(walls[name]) / torch_s,
                     "imports_torch": torch_in, "imports_transformers": tf_in})
    print(f"{'command':<52} {'median':>8} {'peak MiB':>9} {'/ torch':>8}  imports")
    for r in rows:
        imp = "" if r["imports_torch"] is None else f"torch={r['imports_torch']}, transformers={r['imports_transformers']}"
        print(f"{r['command']:<52} {r['median_s']:7.2f}s {r['peak_bytes'] / 2**20:9.1f} {r['vs_import_torch']:8.2f}  {imp}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "cpus": os.cpu_count(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
