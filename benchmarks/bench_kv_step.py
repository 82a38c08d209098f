"""The decode step of the whole model with a 4-bit KV cache against a 16-bit full cache really held (issue 42's
"at most 1.1x the full cache's at 4k tokens, interleaved on an idle machine").

SmolLM2-135M (the bundled GGUF weights, float32 compute), a prompt of ``n`` random token ids (the timing does not
depend on what they say), prefilled once into each cache; then ``--repeats`` rounds in which every cache takes one
decode step on the same new token, the caches in a rotated order each round, so a change of load hits them all.
The table gives the median step, its ratio to the 16-bit full cache's within the run, and the bytes each cache
holds after the prompt (``HeadCache.nbytes``, every tensor counted; a test checks it against a walk).

- ``full 16-bit``: ``kv.full``, keys and values held in float16 (``HeadCache(dtype=torch.float16)``), each step's
  attention in float32: the baseline;
- ``full 16-bit, in place``: the same cache with room for the steps reserved after the prefill, each step's key and
  value written in place (as transformers' ``StaticCache`` holds its tensors), where the baseline appends with
  ``torch.cat`` as transformers' ``DynamicCache`` does: a step of the baseline copies its whole cache, this one
  copies nothing (its bytes are the reserved buffers');
- ``full 32-bit``: the model's own dtype;
- ``4-bit``: ``kv.full(bits=4, group=64, residual=0)`` held in float16 (scales, zeros, the partial key group),
  decode attention on the codes with the compiled kernel (``csrc/codes.cpp``);
- ``4-bit, PyTorch``: the same cache, attention on the codes with PyTorch's products (the kernel not used);
- ``4-bit, residual 128``: ``kv.full(bits=4, group=64)`` (KIVI's 128-token full-precision residual).

    python benchmarks/bench_kv_step.py                       # 1k, 4k and 8k tokens (about 5 minutes on 2 cores)
    python benchmarks/bench_kv_step.py --lengths 4096 --repeats 41
    python benchmarks/bench_kv_step.py --lengths 16384 --positions 16448 --repeats 15 --variants "4-bit" "4-bit, PyTorch"

The variants that differ only in the kernel share one cache (the kernel is chosen at each step), so a length costs
one prefill per cache. ``--positions`` raises the model's position limit for the timing only: rotary embeddings are
defined at every position, and a step costs the same whatever the tokens mean, but SmolLM2 was trained to 8,192
positions, so nothing it would say past them is meant (issue 42 asks for the step from 16k tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

import headlab  # noqa: E402
from headlab import kv  # noqa: E402
from headlab.decode import HeadCache  # noqa: E402
from headlab.models.loaded_model import resolve  # noqa: E402

Q4 = "full:bits=4,group=64,residual=0"
VARIANTS = {  # name -> (policy text or None, storage dtype, the compiled kernel on the codes, written in place)
    "full 16-bit": (None, torch.float16, True, False),
    "full 16-bit, in place": (None, torch.float16, True, True),
    "full 32-bit": (None, None, True, False),
    "4-bit": (Q4, torch.float16, True, False),
    "4-bit, PyTorch": (Q4, torch.float16, False, False),
    "4-bit, residual 128": ("full:bits=4,group=64", torch.float16, True, False),
}


def _append_in_place(store, k: torch.Tensor, v: torch.Tensor, new_pos: torch.Tensor) -> None:
    """A decode step's key and value written into the reserved buffers (the store's ``append``, one token)."""
    kb, vb = store.reserved
    t = store.n
    if k.shape[2] != 1 or t >= kb.shape[2]:
        raise SystemExit(f"the in-place cache has room for {kb.shape[2]} tokens; a step would pass it")
    kb[:, :, t], vb[:, :, t] = k[:, :, 0], v[:, :, 0]
    store.keys, store.values = kb[:, :, : t + 1], vb[:, :, : t + 1]
    store.end, store.n = store.end + 1, store.n + 1


def reserve(cache: HeadCache, room: int) -> None:
    """Move each 16-bit store's keys and values into buffers with ``room`` more tokens, which its steps fill."""
    for layer in cache.layers:
        for g in layer.groups:
            k, v = g.keys, g.values
            kb = k.new_empty(*k.shape[:2], k.shape[2] + room, k.shape[3])
            vb = v.new_empty(*v.shape[:2], v.shape[2] + room, v.shape[3])
            kb[:, :, : k.shape[2]], vb[:, :, : v.shape[2]] = k, v
            g.reserved, g.keys, g.values = (kb, vb), kb[:, :, : k.shape[2]], vb[:, :, : v.shape[2]]
            g.append = types.MethodType(_append_in_place, g)


def held_bytes(cache: HeadCache) -> int:
    """``cache.nbytes()``, with an in-place store's reserved buffers counted whole."""
    return sum(sum(t.nbytes for t in g.reserved) if hasattr(g, "reserved") else g.nbytes()
               for layer in cache.layers for g in layer.groups)


def prefill(adapter, model, text: str | None, dtype, ids: torch.Tensor) -> HeadCache:
    cache = HeadCache(adapter, None if text is None else kv.Policy.parse(text), dtype=dtype)
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def use_kernel(cache: HeadCache, native: bool) -> None:
    """Attend on the codes with the compiled kernel (True) or PyTorch's products (False) from the next step."""
    for layer in cache.layers:
        for g in layer.groups:
            if hasattr(g, "native"):
                g.native = native


def key(name: str) -> tuple:
    """What a variant's cache is: variants that differ only in the kernel share one."""
    text, dtype, _, in_place = VARIANTS[name]
    return text, dtype, in_place


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000])
    ap.add_argument("--repeats", type=int, default=21, help="decode steps timed per cache and length")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="the caches timed (the first 16-bit full cache is always among them: the baseline)")
    ap.add_argument("--name", default="kv_step", help="results/<name>.json")
    ap.add_argument("--positions", type=int, default=None,
                    help="raise the model's position limit to this for the timing (see the docstring)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    lm = headlab.load("smollm2")
    adapter, _ = resolve(lm)
    model = adapter.model.eval()
    vocab = model.config.vocab_size
    if args.positions is not None:
        model.config.max_position_embeddings = args.positions
    limit = model.config.max_position_embeddings
    sharing = Counter(key(v) for v in set(args.variants) | {"full 16-bit"})  # variants per cache
    need = max(args.lengths) + (args.repeats + 1) * max(sharing.values())
    if need > limit:
        raise SystemExit(f"--lengths up to {max(args.lengths)} plus {args.repeats + 1} steps per variant of a cache "
                         f"pass the model's {limit} positions; give --positions {need} (or shorter --lengths)")
    from headlab.attention.backends import native

    rows = []
    names = ["full 16-bit"] + [v for v in args.variants if v != "full 16-bit"]
    with torch.no_grad(), adapter.use_backend("auto"):
        for n in args.lengths:
            ids = torch.randint(0, vocab, (1, n), generator=gen)
            shared: dict = {}  # (policy, dtype) -> its cache, prefilled once
            for name in names:
                text, dtype, _, in_place = VARIANTS[name]
                if key(name) not in shared:
                    t0 = time.perf_counter()
                    shared[key(name)] = prefill(adapter, model, text, dtype, ids)
                    if in_place:
                        reserve(shared[key(name)], args.repeats + 1)
                    print(f"{n} tokens: prefilled {text or 'full'} ({dtype}) in {time.perf_counter() - t0:.0f} s",
                          file=sys.stderr, flush=True)
            caches = {name: shared[key(name)] for name in names}
            held = {name: held_bytes(c) for name, c in caches.items()}
            times: dict[str, list[float]] = {name: [] for name in names}
            for r in range(args.repeats + 1):  # the first round warms up, not counted
                tok = torch.randint(0, vocab, (1, 1), generator=gen)
                for name in names[r % len(names):] + names[: r % len(names)]:
                    use_kernel(caches[name], VARIANTS[name][2])
                    pos = torch.tensor([[caches[name].get_seq_length()]])  # a shared cache takes a step per variant
                    t0 = time.perf_counter()
                    model(input_ids=tok, cache=caches[name], use_cache=True, position_ids=pos, logits_to_keep=1)
                    if r:
                        times[name].append(time.perf_counter() - t0)
            base = statistics.median(times["full 16-bit"])
            in_place = statistics.median(times["full 16-bit, in place"]) if "full 16-bit, in place" in times else None
            for name in names:
                med = statistics.median(times[name])
                rows.append({"tokens": n, "variant": name, "step_ms": med * 1e3, "vs_16bit": med / base,
                             "vs_16bit_in_place": None if in_place is None else med / in_place,
                             "bytes": held[name], "bytes_vs_16bit": held[name] / held["full 16-bit"],
                             "steps_ms": [t * 1e3 for t in times[name]]})
            del caches, shared
    kernel = native.kernel() is not None
    print(f"SmolLM2-135M, one decode step of the whole model; median of {args.repeats} interleaved steps, "
          f"{args.threads} torch thread(s); compiled codes kernel {'built' if kernel else 'NOT built: ' + native.error()}")
    print(f"{'tokens':>7} {'variant':<22} {'step ms':>9} {'vs 16-bit':>10} {'vs in place':>12} {'KV bytes':>13} "
          f"{'bytes vs 16-bit':>16}")
    for r in rows:
        ip = "" if r["vs_16bit_in_place"] is None else f"{r['vs_16bit_in_place']:.2f}x"
        print(f"{r['tokens']:>7} {r['variant']:<22} {r['step_ms']:>9.2f} {r['vs_16bit']:>9.2f}x {ip:>12} "
              f"{r['bytes']:>13,} {r['bytes_vs_16bit']:>15.1%}")
    path = write_json(args.name, {"args": vars(args), "kernel_built": kernel, "variants": {
        k: {"policy": v[0], "dtype": str(v[1]), "native": v[2], "in_place": v[3]} for k, v in VARIANTS.items()},
        "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
