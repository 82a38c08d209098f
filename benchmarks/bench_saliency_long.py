"""Gradient and integrated-gradients saliency on SmolLM2 at long inputs, tiled backend, peak memory.

    nice -n 5 python benchmarks/bench_saliency_long.py [--tokens 4096] [--ig-steps 2] [--backends tiled]

Each measurement runs in a fresh process (``headlab.attention.measure.peak_memory_growth``): the model
is loaded and the input built first, then ``headlab.explain(..., methods=("gradient",))`` (or
``("integrated_gradients",)`` with one interpolated input per batch) runs, and the peak growth of
resident memory during that call is reported. What the eager path would hold instead: the saved
softmax weights of every layer and head, ``layers x heads x n^2 x 4`` bytes in float32 (30 x 9 x
4,096^2 x 4 = 18.1 GB at 4,096 tokens), which the tiled backend's backward never materialises.
IG's peak is that of one step (steps run one after another at this length), so ``--ig-steps`` only
changes the time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

WORDS = ("the quick brown fox jumps over the lazy dog while the committee reviews the quarterly report "
         "and everyone waits for the rain to stop ").split()


def _setup(tokens: int, backend: str, method: str, steps: int):
    import torch

    import headlab

    torch.set_num_threads(1)
    lm = headlab.load("smollm2")
    words = []
    while len(lm.tokenizer(" ".join(words))["input_ids"]) < tokens:  # a text of about `tokens` tokens
        words += WORDS
    text = " ".join(words)
    while len(lm.tokenizer(text)["input_ids"]) > tokens:
        text = text.rsplit(" ", 1)[0]
    n = len(lm.tokenizer(text)["input_ids"])
    return lm, text, backend, method, steps, n


def _run(state):
    lm, text, backend, method, steps, n = state
    t0 = time.perf_counter()
    import headlab

    ex = headlab.explain(lm, text, methods=(method,), backend=backend, ig_steps=steps, ig_batch_size=1, warn=False)
    return f"{n} {time.perf_counter() - t0:.1f} {ex.completeness_gap}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ig-steps", type=int, default=2)
    ap.add_argument("--backends", default="tiled")
    ap.add_argument("--methods", default="gradient,integrated_gradients")
    ap.add_argument("--timeout", type=float, default=3000)
    args = ap.parse_args(argv)
    from headlab.attention.measure import peak_memory_growth

    layers, heads = 30, 9
    eager = layers * heads * args.tokens ** 2 * 4
    rows = []
    print(f"SmolLM2-135M at {args.tokens} tokens; eager would save {eager / 1e9:.1f} GB of softmax weights "
          f"({layers} layers x {heads} heads x n^2 x 4 B)")
    for backend in args.backends.split(","):
        for method in args.methods.split(","):
            t = time.perf_counter()
            peak = peak_memory_growth(_run, args.tokens, backend, method, args.ig_steps, setup=_setup,
                                      timeout=args.timeout)
            rows.append({"backend": backend, "method": method, "tokens": args.tokens, "peak_bytes": peak,
                         "eager_weights_bytes": eager, "wall_s": round(time.perf_counter() - t, 1),
                         "ig_steps": args.ig_steps if method == "integrated_gradients" else None})
            print(f"  {backend:<7} {method:<22} peak {peak / 1e9:6.2f} GB  ({peak / eager:.3f} of eager's weights)  "
                  f"{rows[-1]['wall_s']:.0f} s", flush=True)
    path = write_json(f"saliency_long_{args.tokens}_{args.methods.replace(',', '+')}", {"rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
