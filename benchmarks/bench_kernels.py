"""The kernel speed table: headlab's statistics, sparse and tiled kernels against torch's own, each a
ratio to a peer measured in the same run (interleaved pairs, medians).

    .venv/bin/python benchmarks/bench_kernels.py                 # every row (about 15 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_kernels.py --only tiled    # rows whose name starts with "tiled"
    .venv/bin/python benchmarks/bench_kernels.py --reps 3        # fewer repetitions

Rows (batch 1, float32; the goal of each row in the last column):

* ``stats ...``: :func:`headlab.attention_stats` (method ``"tiled"``) against torch SDPA's forward on
  the same q, k, v (4,096 tokens; "all" = lse, entropy, max weight, argmax, mean distance, received);
* ``capture ...``: MiniLM (the bundled all-MiniLM-L6-v2) at 512 tokens capturing every layer's
  ``blocks.*.attn.stats`` against the stock model on SDPA (``headlab.models.load``);
* ``sparse ...``: sliding window 256 (``|i - j| <= 256``), its causal half, BigBird and documents
  against ``torch.compile(flex_attention)`` with the same mask (compile time reported apart), and
  the window's fwd+bwd against dense SDPA fwd+bwd;
* ``tiled ...``: ``headlab.attention(backend="tiled")`` against SDPA (8 heads, head dim 64).

Writes ``benchmarks/results/kernels.json``; ``run_all.py`` runs it and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import headlab
from headlab import masks
from headlab.attention.stats import attention_stats

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

ALL_NO_ROWS = ["lse", "entropy", "max_weight", "argmax", "mean_distance", "received"]


def pair(peer: Callable, ours: Callable, reps: int) -> dict:
    """Interleaved timings (peer, ours, peer, ours, ...) after one warm-up call of each: medians and ratio."""
    peer()
    ours()
    tp, to = [], []
    for _ in range(reps):
        for fn, acc in ((peer, tp), (ours, to)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    p, o = statistics.median(tp), statistics.median(to)
    return {"peer_s": p, "ours_s": o, "ratio": o / p}


def qkv(heads: int, n: int, d: int, grad: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, n, d, generator=g).requires_grad_(grad) for _ in range(3))


def fwd_bwd(fn, q, k, v):
    def step():
        out = fn(q, k, v)
        out.sum().backward()
        for t in (q, k, v):
            t.grad = None
    return step


def stats_rows(reps: int):
    for name, heads, d, stats, with_v in (
            ("stats all + output, H=32 d=128", 32, 128, ALL_NO_ROWS, True),
            ("stats all + output, H=8 d=64", 8, 64, ALL_NO_ROWS, True),
            ("stats lse + entropy, H=32 d=128", 32, 128, ["lse", "entropy"], False),
            ("stats all, no output, H=32 d=128", 32, 128, ALL_NO_ROWS, False)):
        q, k, v = qkv(heads, 4096, d)
        r = pair(lambda: F.scaled_dot_product_attention(q, k, v),
                 lambda: attention_stats(q, k, v if with_v else None, stats=stats), reps)
        yield name, r, "<= 1.3" if "lse" not in name else "<= 1.05"


def capture_rows(reps: int):
    from headlab.models import load
    from headlab.interpret.capture import capture

    loaded = load()  # the bundled MiniLM on SDPA
    tok = loaded.tokenizer
    text = " ".join(["attention"] * 600)
    for batch in (1, 8):
        enc = tok([text] * batch, return_tensors="pt", truncation=True, max_length=512)
        stock = loaded.model

        def peer():
            with torch.inference_mode():
                stock(**enc)

        def ours():
            with torch.inference_mode():
                capture(loaded, enc, sites=["blocks.*.attn.stats"])

        yield f"capture stats, MiniLM 512 tokens, batch {batch}", pair(peer, ours, reps), "<= 1.3"


def sparse_rows(reps: int, lengths: list[int]):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    window = 256
    compiled = torch.compile(flex_attention)
    mask = masks.sliding_window(window)

    def sw(b, h, qi, ki):
        return (qi - ki).abs() <= window

    for n in lengths:
        q, k, v = qkv(8, n, 64)
        bm = create_block_mask(sw, None, None, n, n, device="cpu")
        t0 = time.perf_counter()
        compiled(q, k, v, block_mask=bm)
        compile_s = time.perf_counter() - t0
        r = pair(lambda: compiled(q, k, v, block_mask=bm),
                 lambda: headlab.attention(q, k, v, mask=mask, backend="sparse"), reps)
        r["flex_first_call_s"] = compile_s
        yield f"sparse window 256 fwd vs compiled Flex, {n}", r, "< 1.0"
    n = 8192
    q, k, v = qkv(8, n, 64)
    for label, other in (("causal window 256", masks.sliding_window(window, causal=True)),
                         ("BigBird block 128", masks.bigbird(128)),
                         ("documents 4 x 2048", masks.documents([2048] * 4))):
        dense = other.dense(q_len=n)[0, 0]  # (n, n) bool: Flex reads the same mask from it
        bm = create_block_mask(lambda b, h, qi, ki, dense=dense: dense[qi, ki], None, None, n, n, device="cpu")
        compiled(q, k, v, block_mask=bm)
        r = pair(lambda: compiled(q, k, v, block_mask=bm),
                 lambda: headlab.attention(q, k, v, mask=other, backend="sparse"), reps)
        yield f"sparse {label} fwd vs compiled Flex, {n}", r, "< 1.0"
    q, k, v = qkv(8, n, 64, grad=True)
    r = pair(fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), q, k, v),
             fwd_bwd(lambda a, b, c: headlab.attention(a, b, c, mask=mask, backend="sparse"), q, k, v), reps)
    yield f"sparse window 256 fwd+bwd vs dense SDPA, {n}", r, "<= 1/12 = 0.083"


def tiled_rows(reps: int, lengths: list[int]):
    for n in lengths:
        q, k, v = qkv(8, n, 64)
        r = pair(lambda: F.scaled_dot_product_attention(q, k, v),
                 lambda: headlab.attention(q, k, v, backend="tiled"), reps)
        yield f"tiled fwd, {n}", r, "<= 1.3" if n < 2048 else "<= 1.1"
    for n in lengths:
        q, k, v = qkv(8, n, 64, grad=True)
        r = pair(fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v),
                 fwd_bwd(lambda a, b, c: headlab.attention(a, b, c, causal=True, backend="tiled"), q, k, v), reps)
        yield f"tiled fwd+bwd causal, {n}", r, "<= 1.1 from 2048"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated row-name prefixes (stats, capture, sparse, tiled)")
    ap.add_argument("--sparse-lengths", default="4096,8192,16384")
    ap.add_argument("--tiled-lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--name", default="kernels", help="results file name (benchmarks/results/NAME.json)")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    groups = {
        "stats": lambda: stats_rows(args.reps),
        "capture": lambda: capture_rows(args.reps),
        "sparse": lambda: sparse_rows(args.reps, [int(x) for x in args.sparse_lengths.split(",")]),
        "tiled": lambda: tiled_rows(args.reps, [int(x) for x in args.tiled_lengths.split(",")]),
    }
    rows = []
    print(f"{'row':52s} {'peer s':>9s} {'ours s':>9s} {'ratio':>7s}  goal")
    for g, make in groups.items():
        if only and not any(g.startswith(o) or o.startswith(g) for o in only):
            continue
        for name, r, goal in make():
            if only and not any(name.startswith(o) for o in only):
                continue
            rows.append({"row": name, "goal": goal, **r})
            print(f"{name:52s} {r['peer_s']:9.4f} {r['ours_s']:9.4f} {r['ratio']:7.2f}  {goal}", flush=True)
    path = write_json(args.name, {"command": "python benchmarks/bench_kernels.py " + " ".join(argv or sys.argv[1:]),
                                  "reps": args.reps, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
