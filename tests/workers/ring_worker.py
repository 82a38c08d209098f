"""One rank of the ring-attention tests: ``python ring_worker.py RANK WORLD PORT OUT_DIR CASES...``.

Builds the same full q, k, v, dO on every rank from a seed, runs ring attention (forward and
backward) and ring statistics on this rank's shard, and saves the shards to ``OUT_DIR/rank{R}.pt``.
The test process compares them with single-process headlab.attention. Talks over gloo on 127.0.0.1
only. Special cases: ``mismatch`` (rank 1 passes another head count: every rank must raise the same
DistributedError) and ``die`` (rank 1 exits at once: rank 0 must fail after the timeout, not hang).
"""

from __future__ import annotations

import os
import zlib
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from headlab import masks
from headlab.distributed import ring_attention, ring_attention_stats, shard
from headlab.errors import DistributedError

# name -> (dtype, B, H, Hkv, chunk per 2W, d, causal, layout, mask spec)
CASES = {
    "full-contiguous-gqa": (torch.float32, 2, 4, 2, 13, 16, False, "contiguous", None),
    "causal-zigzag-gqa": (torch.float32, 1, 6, 2, 11, 24, True, "zigzag", None),
    "causal-contiguous": (torch.float32, 1, 2, 2, 17, 8, True, "contiguous", None),
    "window-causal-zigzag": (torch.float32, 1, 2, 1, 9, 16, True, "zigzag", ("sliding_window", 5)),
    "documents-zigzag": (torch.float32, 1, 2, 2, 8, 16, False, "zigzag", ("documents", None)),
    "causal-zigzag-f64": (torch.float64, 1, 2, 1, 7, 8, True, "zigzag", None),
    "causal-zigzag-bf16": (torch.bfloat16, 1, 4, 2, 16, 32, True, "zigzag", None),
}


def full_inputs(name: str, world: int):
    dtype, B, H, Hkv, c, d, causal, layout, spec = CASES[name]
    n = 2 * world * c
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + world)
    q = torch.randn(B, H, n, d, generator=g) * 1.5
    k = torch.randn(B, Hkv, n, d, generator=g) * 1.5
    v = torch.randn(B, Hkv, n, d, generator=g)
    do = torch.randn(B, H, n, d, generator=g)
    mask = None
    if spec is not None and spec[0] == "sliding_window":
        mask = masks.sliding_window(spec[1])
    elif spec is not None and spec[0] == "documents":
        cut = [n // 3, n - 2 * (n // 3) - 1, n // 3 + 1]  # three documents that straddle the shards
        mask = masks.documents(cut)
    return [t.to(dtype) for t in (q, k, v, do)], dict(causal=causal, layout=layout, mask=mask)


def main() -> None:
    rank, world, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cases = sys.argv[5:]
    torch.set_num_threads(1)
    timeout = timedelta(seconds=8 if "die" in cases else 60)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)
    results = {}
    try:
        for name in cases:
            if name == "die":
                if rank == 1:
                    os._exit(0)
                try:
                    q = torch.randn(1, 2, 8, 8)
                    ring_attention(q, q, q)
                    results["die"] = "no error"
                except DistributedError as e:
                    results["die"] = str(e)
                continue
            if name == "mismatch":
                heads = 2 if rank != 1 else 4
                q = torch.randn(1, heads, 8, 8)
                try:
                    ring_attention(q, q, q)
                    results["mismatch"] = "no error"
                except DistributedError as e:
                    results["mismatch"] = str(e)
                continue
            (q, k, v, do), kw = full_inputs(name, world)
            parts = [shard(t, rank=rank, world_size=world, layout=kw["layout"]) for t in (q, k, v, do)]
            qs, ks, vs, dos = (p.requires_grad_(True) if i < 3 else p for i, p in enumerate(parts))
            out = ring_attention(qs, ks, vs, **kw)
            dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), dos)
            st = ring_attention_stats(qs.detach(), ks.detach(), **kw)
            results[name] = {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv,
                             **{f"stats.{k_}": getattr(st, k_) for k_ in ("lse", "entropy", "max_weight", "argmax",
                                                                         "mean_distance", "received")}}
    except Exception:  # noqa: BLE001  (reported to the test process, which shows it)
        import traceback

        results["error"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        if "die" not in cases:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
