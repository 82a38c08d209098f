"""What the load-time check costs: ``verify`` (the six checks) and ``discover`` (reading a layout from structure).

On SmolLM2-135M (30 layers, 9 heads on 3 kv heads) and MiniLM (6 layers, 12 heads), on the check's own input
(8 tokens): the median of ``--repeats`` runs of each, in wall and CPU seconds, against the peer measured in the
same run, one eager forward of the model on the same input (the check runs four forwards and discovery two, so
about 4x and 2x a forward is what they should cost). The goal (issue 30): the check under 1 s on a 135M model
on 2 cores. Model load time is excluded.

    .venv/bin/python benchmarks/bench_check.py                    # both models, 5 repeats
    .venv/bin/python benchmarks/bench_check.py --model smollm2 --repeats 9

Writes ``benchmarks/results/load_check.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402


def _timed(fn, repeats: int) -> dict:
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "wall_all": walls}


def measure(name: str, repeats: int) -> dict:
    import headlab
    from headlab.models.hf.structure import discover
    from headlab.models.hf.trace import implementation
    from headlab.models.hf.verify import verify
    from headlab.models.inputs import example_inputs

    lm = headlab.load(name)
    model = lm.model
    x = example_inputs(model, tokens=8)

    def forward():
        with torch.no_grad(), implementation(model, "eager"):
            model(**x)
    forward()  # warm-up
    verdict = verify(lm.adapter, cache=False)
    row = {"model": name, "layers": lm.adapter.n_layers, "heads": lm.adapter.n_heads, "passed": verdict.passed,
           "checks": {c.name: c.worst for c in verdict.checks},
           "forward": _timed(forward, repeats),
           "verify": _timed(lambda: verify(lm.adapter, cache=False), repeats),
           "discover": _timed(lambda: discover(model), repeats)}
    f = row["forward"]["wall_s"]
    row["verify_x_forward"] = row["verify"]["wall_s"] / f
    row["discover_x_forward"] = row["discover"]["wall_s"] / f
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "minilm", "both"], default="both")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    names = ["smollm2", "minilm"] if args.model == "both" else [args.model]
    rows = [measure(n, args.repeats) for n in names]
    print(f"{'model':<9} {'forward':>9} {'verify':>9} {'(cpu)':>8} {'x fwd':>6} {'discover':>9} {'x fwd':>6}  passed")
    for r in rows:
        print(f"{r['model']:<9} {r['forward']['wall_s']:>8.3f}s {r['verify']['wall_s']:>8.3f}s "
              f"{r['verify']['cpu_s']:>7.2f}s {r['verify_x_forward']:>6.1f} {r['discover']['wall_s']:>8.3f}s "
              f"{r['discover_x_forward']:>6.1f}  {r['passed']}")
    path = write_json("load_check", {"repeats": args.repeats, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
