"""Attention flow: headlab's certified scipy Dinic against the paper's networkx Edmonds-Karp, same run.

    nice -n 5 .venv/bin/python benchmarks/bench_flow.py                    # 16, 32, 64 tokens vs networkx; 256 alone
    nice -n 5 .venv/bin/python benchmarks/bench_flow.py --lens 16 --long 0 # quick

MiniLM (all-MiniLM-L6-v2, 6 layers), a text cut to n tokens (the [CLS] ... [SEP] of a longer one), the
paper's graph (mean of heads + I, rows normalised), the flow from the [CLS] node at the last layer's
output to every input node: n max-flows. Both solvers get the same capacity matrices; times are of
the solvers alone (graph building included, the model forward excluded; it is the same for both),
in CPU seconds of this process (``time.process_time``: both solvers are single-threaded, and CPU time
is not inflated by the other jobs of a shared machine), best of ``--repeat`` runs for headlab and one
run for networkx. Abnar and Zuidema's own code is the
networkx loop (one ``maximum_flow_value(..., flow_func=edmonds_karp)`` per input node). "x faster"
= networkx time / headlab time. The long run (256 tokens by default) is timed end to end (forward
included) with torch limited to 2 threads. Past ``--nx-sinks`` input nodes (default 16) networkx solves
that many evenly spaced ones and its time for all n is extrapolated linearly (marked ``*``; each
sink is an independent max-flow on the same graph, so the per-sink time is what it is).
Writes benchmarks/results/flow.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

import headlab  # noqa: E402
from headlab.interpret.flow.maxflow import attention_flow, flow_values  # noqa: E402
from headlab.interpret.flow.record import record  # noqa: E402
from headlab.interpret.flow.rollout import augment, layer_matrices  # noqa: E402

TEXT = ("Attention flow treats the attention graph of a transformer as a flow network: every token of every "
        "layer is a node, and the capacity of the edge between two nodes is the attention weight plus the "
        "residual connection, normalised. The maximum flow from an output token to an input token bounds "
        "how much information can travel between them. ")


def inputs(lm, n: int) -> dict:
    ids = lm.encode(TEXT * (1 + n // 40), max_length=512, truncate=True)["input_ids"][:, :n].clone()
    ids[0, -1] = lm.tokenizer.sep_token_id
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="16,32,64")
    ap.add_argument("--long", type=int, default=256, help="length timed end to end on 2 threads (0: skip)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--name", default="flow", help="results/<name>.json")
    ap.add_argument("--nx-sinks", type=int, default=16,
                    help="networkx solves at most this many input nodes (evenly spaced); its time for all n is "
                         "extrapolated (per-sink time x n) and labelled so")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    lm = headlab.load("minilm")
    rows = []
    print(f"{'tokens':>6} {'edges':>8} {'headlab cpu s':>13} {'networkx cpu s':>15} {'x faster':>9} {'max |diff|':>11} {'gap':>9}")
    for n in [int(x) for x in args.lens.split(",") if x]:
        enc = inputs(lm, n)
        rec = record(lm, enc, maps=True)
        A = augment(layer_matrices(rec, "mean"))  # (6, n, n) float64
        L = A.shape[0]
        best, cpu = None, float("inf")
        for _ in range(args.repeat):
            c0 = time.process_time()
            got = flow_values(A, 0, L)
            c = time.process_time() - c0
            if c < cpu:
                best, cpu = got, c
        best.seconds = cpu
        sinks = list(range(n)) if n <= args.nx_sinks else np.linspace(0, n - 1, args.nx_sinks).round().astype(int).tolist()
        c0 = time.process_time()
        ref = flow_values(A, 0, L, solver="networkx", sinks=sinks)
        nx_all = (time.process_time() - c0) * n / len(sinks)
        diff = float(np.abs(best.values[sinks] - ref.values[sinks]).max())
        row = {"tokens": n, "edges": int((A > 0).sum()), "headlab_s": best.seconds, "networkx_s": nx_all,
               "networkx_sinks_solved": len(sinks), "networkx_extrapolated": len(sinks) < n,
               "x_faster": nx_all / best.seconds, "max_abs_diff": diff, "certificate_gap": best.gap}
        rows.append(row)
        mark = "*" if len(sinks) < n else " "
        print(f"{n:>6} {row['edges']:>8} {best.seconds:>13.4f} {nx_all:>14.2f}{mark} {row['x_faster']:>9.0f} "
              f"{diff:>11.1e} {best.gap:>9.1e}", flush=True)
    if any(r["networkx_extrapolated"] for r in rows):
        print(f"* networkx solved {args.nx_sinks} evenly spaced input nodes; its time for all n is that time x n / "
              f"{args.nx_sinks} (max |diff| over those nodes)")
    long = None
    if args.long:
        enc = inputs(lm, args.long)
        t0, c0 = time.perf_counter(), time.process_time()
        res = attention_flow(lm, enc, source=0)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        long = {"tokens": args.long, "threads": 2, "end_to_end_s": wall, "end_to_end_cpu_s": cpu, "solver_wall_s": res.seconds,
                "certificate_gap": res.gap, "flow_sum": float(res.flow.sum())}
        print(f"{args.long} tokens, all {args.long} input nodes for [CLS], 2 threads: {wall:.1f} s wall, "
              f"{cpu:.1f} s CPU end to end (solver {res.seconds:.1f} s wall), certificate gap {res.gap:.1e}")
    path = write_json(args.name, {"model": "all-MiniLM-L6-v2", "source": "[CLS] at the last layer",
                               "paper_algorithm": "networkx maximum_flow_value, edmonds_karp, one call per input node",
                               "rows": rows, "long": long})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
