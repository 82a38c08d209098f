"""Worst error ratio to the plain same-precision implementation, per backend, over the shared case
table (tests/cases.py): the FlashAttention rule's yardstick (Dao et al. 2022; flash-attention's
tests bound a kernel's error by 2x (outputs) / 3x (gradients) the plain implementation's).

    .venv/bin/python benchmarks/bench_error_ratio.py            # every exact backend
    .venv/bin/python benchmarks/bench_error_ratio.py --backends tiled,sparse --name before

A ratio is ``max|backend - ref64| / max(max|plain - ref64|, flash floor)`` for the output and for
each gradient; the table gives the worst over the float32 cases and over all cases, with the
case that reached it. Writes benchmarks/results/<name>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _common import write_json  # noqa: E402
from cases import CASES, make_inputs, supported  # noqa: E402

from headlab.errors import HeadlabError  # noqa: E402
from headlab.testing import compare_backend  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="reference,sdpa,tiled,sparse")
    ap.add_argument("--name", default="error_ratio", help="results/<name>.json")
    args = ap.parse_args(argv)
    rows, per_case = [], {}
    for be in args.backends.split(","):
        worst = {"float32": {"out": (0.0, ""), "grad": (0.0, "")}, "all": {"out": (0.0, ""), "grad": (0.0, "")}}
        failed, skipped = [], []
        for c in CASES:
            q, k, v, mask = make_inputs(c)
            try:
                ok, why = supported(be, c, q, k, v, mask)
                if not ok:
                    skipped.append(f"{c.name}: {why}")
                    continue
                rep = compare_backend(be, q, k, v, mask=mask, causal=c.causal, scale=c.scale)
            except HeadlabError as e:
                skipped.append(f"{c.name}: {type(e).__name__}: {e}")
                continue
            per_case[f"{be}/{c.name}"] = {n: round(r, 3) for n, r in rep.ratios().items()}
            if not rep.ok:
                failed.append(c.name)
            for n, r in rep.ratios().items():
                kind = "out" if n == "out" else "grad"
                for scope in ("all", "float32") if c.dtype == torch.float32 else ("all",):
                    if r > worst[scope][kind][0]:
                        worst[scope][kind] = (r, f"{c.name}:{n}")
        rows.append({"backend": be, "worst": worst, "failed": failed, "skipped": skipped})
        print(f"{be:10s} float32: out {worst['float32']['out'][0]:6.2f} ({worst['float32']['out'][1]}), "
              f"grad {worst['float32']['grad'][0]:6.2f} ({worst['float32']['grad'][1]}); "
              f"all: out {worst['all']['out'][0]:6.2f} ({worst['all']['out'][1]}), "
              f"grad {worst['all']['grad'][0]:6.2f} ({worst['all']['grad'][1]}); "
              f"fails {len(failed)} {failed}; skipped {len(skipped)}", flush=True)
    path = write_json(args.name, {"rows": rows, "per_case": per_case})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
