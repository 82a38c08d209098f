"""Ring attention on 2 local ranks (1 thread each) against one process with 2 threads.

    .venv/bin/python benchmarks/bench_ring.py                          # 16,384 and 32,768 tokens
    .venv/bin/python benchmarks/bench_ring.py --seq-lens 4096 --repeats 1

Batch 1, 8 heads, head dim 64, float32, causal, zigzag layout. The peer is headlab's own ``tiled``
backend on the whole sequence in one process with torch's 2 threads (the same machine, the same
cores). Each configuration runs in fresh processes (gloo on 127.0.0.1). Reported per length:
forward and forward + backward time (median of the repeats; for the ring, the slowest rank), the
ratio ring / single, the peak resident memory of each process during forward + backward (beyond
what it held before the call, and with its inputs counted), and the bytes each rank sent against
the cost model's prediction (headlab.costs.ring.ring_cost). Each process first runs one full-size
forward + backward whose time and peak are reported apart ("first call": it also holds what a
process touches once, such as the allocator's growth and the backward's first use); the repeats
after it are the steady state of a training step. Writes benchmarks/results/ring.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

B, H, D = 1, 8, 64


def _inputs(n: int, requires_grad: bool):
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, n, D, generator=g).requires_grad_(requires_grad) for _ in range(3)] + \
        [torch.randn(B, H, n, D, generator=g)]


def worker(rank: int, world: int, port: int, n: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from headlab.attention.core import attention
    from headlab.attention.measure import rss_bytes, run_with_peak
    from headlab.distributed import comm, ring_attention, shard

    torch.set_num_threads(1 if world > 1 else 2)
    base = rss_bytes()
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        full = _inputs(n, False)
        q, k, v, do = (shard(t, rank=rank, world_size=world, layout="zigzag") for t in full)
        del full
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))

        def fwd():
            return ring_attention(q, k, v, causal=True, layout="zigzag")
    else:
        q, k, v, do = _inputs(n, True)

        def fwd():
            return attention(q, k, v, causal=True, backend="tiled")

    def fwd_bwd():
        out = fwd()
        return torch.autograd.grad(out, (q, k, v), do)

    input_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, do))
    with torch.no_grad():  # warm-up on a small piece: loads the kernels, costs little
        small = [t[:, :, : 2 * 2 * 128].detach() for t in (q, k, v)]
        (ring_attention(*small, causal=True, layout="zigzag") if world > 1 else
         attention(*small, causal=True, backend="tiled"))
    runs = {"first": ([], [], []), "fwd": ([], [], []), "fwd_bwd": ([], [], [])}  # times, peaks, bytes sent

    def measure(name, fn, grad):
        if world > 1:
            dist.barrier()
        before = comm.bytes_sent()
        with torch.set_grad_enabled(grad):
            seconds, peak = run_with_peak(fn)
        times, peaks, sent = runs[name]
        times.append(seconds)
        peaks.append(peak)
        sent.append(comm.bytes_sent() - before)

    # the first full-size forward + backward, apart: its peak also holds what a process touches once
    # (allocator growth, the backward's first use); the repeats after it are the steady state a
    # training step sees
    measure("first", fwd_bwd, True)
    for _ in range(repeats):
        measure("fwd", fwd, False)
        measure("fwd_bwd", fwd_bwd, True)
    (times_f, peaks_f, sent_f), (times_fb, peaks_fb, sent_fb) = runs["fwd"], runs["fwd_bwd"]
    sent_fwd, sent_both = sent_f[0], sent_fb[0]
    if world > 1:
        dist.destroy_process_group()
    return {"rank": rank, "forward_s": statistics.median(times_f), "fwd_bwd_s": statistics.median(times_fb),
            "peak_extra_fwd": max(peaks_f), "peak_extra_fwd_bwd": max(peaks_fb), "input_bytes": input_bytes,
            "first_call_s": runs["first"][0][0], "first_call_peak_extra": runs["first"][1][0],
            "rss_before_inputs": base, "sent_forward": sent_fwd, "sent_fwd_bwd": sent_both}


def _launch(world: int, n: int, repeats: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1" if world > 1 else "2"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(port), str(n),
                               str(repeats)], env=env, stdout=subprocess.PIPE) for r in range(world)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=3600)
        if p.returncode:
            raise SystemExit(f"a worker failed (exit {p.returncode})")
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default="16384,32768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="ring", help="results file benchmarks/results/NAME.json")
    ap.add_argument("--worker", nargs=5, metavar=("RANK", "WORLD", "PORT", "N", "REPEATS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        r, w, port, n, rep = (int(x) for x in args.worker)
        print(json.dumps(worker(r, w, port, n, rep)))
        return
    from _common import write_json

    from headlab.spec.memory_guard import human_bytes
    from headlab.costs import AttentionShape
    from headlab.costs.ring import ring_cost

    rows = []
    for n in (int(x) for x in args.seq_lens.split(",")):
        single = _launch(1, n, args.repeats)[0]
        ring = _launch(2, n, args.repeats)
        pred = ring_cost(AttentionShape(heads=H, q_len=n, head_dim=D, causal=True), ranks=2)
        slow_f = max(r["forward_s"] for r in ring)
        slow_fb = max(r["fwd_bwd_s"] for r in ring)
        peak_rank = max(r["peak_extra_fwd_bwd"] + r["input_bytes"] for r in ring)
        peak_single = single["peak_extra_fwd_bwd"] + single["input_bytes"]
        first_rank = max(r["first_call_peak_extra"] + r["input_bytes"] for r in ring)
        first_single = single["first_call_peak_extra"] + single["input_bytes"]
        sent = max(r["sent_fwd_bwd"] for r in ring)
        predicted = pred.sent_forward_bytes + pred.sent_backward_bytes
        row = {"seq_len": n, "single_forward_s": single["forward_s"], "ring_forward_s": slow_f,
               "forward_time_ratio": slow_f / single["forward_s"], "single_fwd_bwd_s": single["fwd_bwd_s"],
               "ring_fwd_bwd_s": slow_fb, "fwd_bwd_time_ratio": slow_fb / single["fwd_bwd_s"],
               "single_peak_bytes": peak_single, "ring_peak_bytes_per_rank": peak_rank,
               "memory_ratio": peak_rank / peak_single,
               "first_call_single_peak_bytes": first_single, "first_call_ring_peak_bytes_per_rank": first_rank,
               "first_call_memory_ratio": first_rank / first_single,
               "single_peak_extra_bytes": single["peak_extra_fwd_bwd"],
               "ring_peak_extra_bytes_per_rank": max(r["peak_extra_fwd_bwd"] for r in ring),
               "sent_bytes_per_rank": sent, "predicted_sent_bytes_per_rank": predicted,
               "sent_over_predicted": sent / predicted, "ranks": ring, "single": single}
        rows.append(row)
        print(f"{n:>7} tokens  fwd ring/single {row['forward_time_ratio']:.2f}  fwd+bwd {row['fwd_bwd_time_ratio']:.2f}  "
              f"peak per rank {human_bytes(peak_rank)} vs {human_bytes(peak_single)} ({row['memory_ratio']:.2f}; "
              f"first call {row['first_call_memory_ratio']:.2f})  "
              f"sent {human_bytes(sent)} vs predicted {human_bytes(predicted)} ({row['sent_over_predicted']:.3f})",
              flush=True)
    write_json(args.name, {"config": {"batch": B, "heads": H, "head_dim": D, "dtype": "float32", "causal": True,
                                   "layout": "zigzag", "ranks": 2, "threads_per_rank": 1, "single_threads": 2,
                                   "repeats": args.repeats}, "rows": rows})


if __name__ == "__main__":
    main()
