"""One decode step of a quantized KV cache: attention on the codes against dequantize-then-attend and a 16-bit cache.

One layer of SmolLM2-135M's attention shape (9 query heads on 3 kv heads, head dim 64), fed random keys (with
channels of different ranges, as keys have) and values; the model computes in float32 and every cache holds its
keys, values, scales, zero points and full-precision residual in float16 (``HeadCache(dtype=torch.float16)``), so
the bytes are in 16-bit terms. At each context length the step (one new token enters the cache, which may quantize
its residual, then the new query attends to all that is held) is timed for:

- ``full 16-bit``: ``kv.full``, held in float16, each step's attention in float32 (torch's SDPA);
- ``4-bit codes`` / ``2-bit codes``: ``kv.full(bits=4)`` (KIVI: keys per channel, values per token, groups of
  ``--group``, a residual of 128), attention computed on the codes (:func:`headlab.decode.codes.attend_codes`);
- ``4-bit codes, residual=0``: the same with no full-precision residual but a key group not yet whole;
- ``4-bit codes, PyTorch``: the 4-bit cache on the codes with PyTorch's products, not the compiled kernel
  (``csrc/codes.cpp``, which the ``codes`` variants use when it is built);
- ``4-bit dequantize``: the same cache read back to float first, then attended (round two's path).

The variants run interleaved (each repeat times one step of each, in turn), so a change of load hits all of them;
the table gives the median step and its ratio to the 16-bit cache's within this run, and the bytes each cache
holds (its tensors, all counted: ``HeadCache.nbytes``, which a test checks against a walk of the tensors). Timings on
a shared machine are indicative only; the ratios inside one run are what count.

    python benchmarks/bench_kv_codes.py                        # 1k, 4k, 16k tokens (under a minute on 2 cores)
    python benchmarks/bench_kv_codes.py --lengths 2048 --repeats 15 --group 64
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

from headlab import kv  # noqa: E402
from headlab.decode.cache import HeadLayer, _hold  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's attention


def variants(group: int) -> dict[str, tuple]:
    """name -> (rule, attends on the codes, with the compiled kernel)."""
    q4 = kv.full(bits=4, group=group, residual=128)
    q4r0 = kv.full(bits=4, group=group, residual=0)
    return {"full 16-bit": (kv.full, True, True), "4-bit codes": (q4, True, True),
            "4-bit codes, residual=0": (q4r0, True, True), "4-bit codes, PyTorch": (q4, True, False),
            "4-bit dequantize": (q4, False, False), "2-bit codes": (kv.full(bits=2, group=group, residual=128), True,
                                                                    True)}


def build(rule, codes: bool, native: bool, k: torch.Tensor, v: torch.Tensor) -> HeadLayer:
    """A layer holding ``k``, ``v`` ``(1, KV_HEADS, n, DIM)`` under ``rule`` in float16, as a prefill leaves it (the
    prompt's attention itself is not what is timed, so it is not run: the quantized stores flush as after it)."""
    layer = HeadLayer([rule] * KV_HEADS, HEADS)
    _hold([layer], torch.float16, codes)
    layer.update(k, v)
    for g in layer.groups:
        if hasattr(g, "flush"):
            g.native = native  # the compiled kernel on the codes, or PyTorch's products
            g.flush(k.shape[2])  # KIVI: what has passed the boundaries is quantized
    return layer


def step(layer: HeadLayer, k1: torch.Tensor, v1: torch.Tensor, q1: torch.Tensor) -> float:
    t0 = time.perf_counter()
    layer.update(k1, v1)[0].headlab_attend(None, q1, None, scaling=DIM ** -0.5)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=31, help="steps timed per variant and length")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--group", type=int, default=32, choices=[32, 64, 128])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rows = []
    with torch.no_grad():
        for n in args.lengths:
            spread = torch.linspace(0.2, 4.0, DIM)
            k, v = torch.randn(1, KV_HEADS, n, DIM) * spread, torch.randn(1, KV_HEADS, n, DIM)
            layers = {name: build(rule, codes, nat, k, v) for name, (rule, codes, nat) in variants(args.group).items()}
            times: dict[str, list[float]] = {name: [] for name in layers}
            for _ in range(args.repeats + 1):  # the first round warms up, not counted
                k1, v1 = torch.randn(1, KV_HEADS, 1, DIM) * spread, torch.randn(1, KV_HEADS, 1, DIM)
                q1 = torch.randn(1, HEADS, 1, DIM)
                for name, layer in layers.items():  # interleaved
                    times[name].append(step(layer, k1, v1, q1))
            base = statistics.median(times["full 16-bit"][1:])
            base_bytes = layers["full 16-bit"].nbytes()
            for name, layer in layers.items():
                med = statistics.median(times[name][1:])
                rows.append({"tokens": n, "variant": name, "step_ms": med * 1e3, "vs_16bit": med / base,
                             "bytes": layer.nbytes(), "bytes_vs_16bit": layer.nbytes() / base_bytes,
                             "steps_ms": [t * 1e3 for t in times[name][1:]]})
    print(f"one decode step, one layer ({HEADS} query heads on {KV_HEADS} kv heads, head dim {DIM}), float16 storage, "
          f"groups of {args.group}; median of {args.repeats} interleaved steps, {args.threads} torch thread(s)")
    print(f"{'tokens':>7} {'variant':<24} {'step ms':>9} {'vs 16-bit':>10} {'bytes held':>12} {'bytes vs 16-bit':>16}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['variant']:<24} {r['step_ms']:>9.3f} {r['vs_16bit']:>9.2f}x {r['bytes']:>12,} "
              f"{r['bytes_vs_16bit']:>15.1%}")
    path = write_json("kv_codes", {"args": vars(args), "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM},
                                   "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
