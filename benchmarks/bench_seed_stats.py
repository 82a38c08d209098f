"""The seed's scenario, made cheap: every per-head statistic of a 32-layer x 32-head stack at
4,096 tokens, without one n x n map.

The seed text: 32 layers x 32 heads at 4,096 tokens "would need 32 GB just for attention weights"
(float16). This script computes, layer after layer (random q/k/v, batch 1, head dim 128, float32),
every statistic of :func:`headlab.attention_stats` (lse, entropy, max weight and argmax, mean
distance, mass on chosen keys, mass received, exact rows for chosen queries), keeps only the
per-layer statistics, and prints the process's peak memory next to the 32 GiB that materialising
every map would take. Torch's fused SDPA forward on the same q/k/v is timed in the same run as a
peer (it computes the attention output only, no statistic).

After the main run (so that it cannot raise the measured peak) the first ``--compare-layers``
layers are timed again to compare the two ways of computing the statistics that both support
(lse, entropy, mean distance, key mass, received, rows): ``method="tiled"`` vs ``method="sdpa"``.

    python benchmarks/bench_seed_stats.py                # the full scenario (minutes on 2 cores)
    python benchmarks/bench_seed_stats.py --layers 2     # a quick run

Writes ``benchmarks/results/seed_stats.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

import headlab
from headlab.units import human_bytes
from headlab.attention.stats import SDPA_STATS, attention_stats
from headlab.costs import AttentionShape, estimate

RESULTS = Path(__file__).resolve().parent / "results"
LIMIT = 2 << 30  # the bound on peak memory


def rss_bytes() -> int:
    """Resident memory of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def layer_inputs(layer: int, heads: int, seq: int, dim: int):
    g = torch.Generator().manual_seed(1000 + layer)
    return tuple(torch.randn(1, heads, seq, dim, generator=g) for _ in range(3))  # (B, H, T, D) each


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true", help="causal attention (default: full)")
    ap.add_argument("--compare-layers", type=int, default=2,
                    help="layers re-timed afterwards with method='tiled' vs method='sdpa' (0: skip)")
    ap.add_argument("--json", type=Path, default=RESULTS / "seed_stats.json")
    args = ap.parse_args(argv)
    if min(args.layers, args.heads, args.seq_len, args.head_dim) <= 0 or args.compare_layers < 0:
        ap.error("sizes must be positive")

    L, H, T, D = args.layers, args.heads, args.seq_len, args.head_dim
    key_positions = [0, T // 2]  # the first token and a "separator" in the middle
    query_rows = [0, T // 2, T - 1]
    materialised = estimate(AttentionShape(heads=H, q_len=T, layers=L, dtype="float16"),
                            "reference").attention_weights_bytes
    seed_bytes = estimate(AttentionShape(heads=32, q_len=4096, layers=32, dtype="float16"),
                          "reference").attention_weights_bytes

    # warm up torch's kernels on a tiny problem so that first-call costs are not in the numbers
    wq = torch.randn(1, 2, 64, D)
    attention_stats(wq, wq, key_positions=[0], query_rows=[0])
    torch.nn.functional.scaled_dot_product_attention(wq, wq, wq)
    base_rss = rss_bytes()

    print(f"seed scenario: {L} layers x {H} heads x {T} tokens, head dim {D}, float32, "
          f"{'causal' if args.causal else 'full'} attention; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    kept = []
    rows = []
    t_start = time.perf_counter()
    for layer in range(L):
        q, k, v = layer_inputs(layer, H, T, D)
        st, t_stats = timed(lambda: attention_stats(q, k, causal=args.causal, key_positions=key_positions,
                                                    query_rows=query_rows))
        _, t_sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal))
        kept.append(st)
        del q, k, v
        means = st.head_means()
        rows.append({
            "layer": layer, "stats_s": t_stats, "sdpa_forward_s": t_sdpa, "ratio_to_sdpa": t_stats / t_sdpa,
            "mean_entropy": float(means["entropy"].mean()), "mean_max_weight": float(means["max_weight"].mean()),
            "mean_distance": float(means["mean_distance"].mean()),
            "mass_on_first_token": float(st.key_mass[..., 0].mean()),
        })
        print(f"  layer {layer + 1:2d}/{L}: statistics {t_stats:7.2f} s, sdpa forward {t_sdpa:6.2f} s "
              f"(time / sdpa {t_stats / t_sdpa:4.1f}), peak RSS {human_bytes(peak_rss_bytes())}", flush=True)
    wall = time.perf_counter() - t_start
    peak = peak_rss_bytes()
    kept_bytes = sum(s.nbytes() for s in kept)
    growth = peak - base_rss

    comparison = None
    if args.compare_layers:
        tiled_t, sdpa_t, peer_t = [], [], []
        for layer in range(min(args.compare_layers, L)):
            q, k, v = layer_inputs(layer, H, T, D)
            kw = dict(causal=args.causal, key_positions=key_positions, query_rows=query_rows, stats=SDPA_STATS)
            _, ts = timed(lambda: attention_stats(q, k, method="sdpa", **kw))
            _, tt = timed(lambda: attention_stats(q, k, method="tiled", **kw))
            _, tp = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal))
            sdpa_t.append(ts)
            tiled_t.append(tt)
            peer_t.append(tp)
            del q, k, v
        comparison = {
            "stats": list(SDPA_STATS), "layers": len(tiled_t),
            "tiled_s": statistics.median(tiled_t), "sdpa_method_s": statistics.median(sdpa_t),
            "sdpa_forward_s": statistics.median(peer_t),
            "faster": "tiled" if statistics.median(tiled_t) < statistics.median(sdpa_t) else "sdpa",
        }

    result = {
        "scenario": {"layers": L, "heads": H, "seq_len": T, "head_dim": D, "batch": 1, "dtype": "float32",
                     "causal": args.causal, "key_positions": key_positions, "query_rows": query_rows},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "python": sys.version.split()[0]},
        "command": "python benchmarks/bench_seed_stats.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "peak_rss_bytes": peak, "baseline_rss_bytes": base_rss, "peak_growth_bytes": growth,
        "kept_statistics_bytes": kept_bytes,
        "materialised_float16_bytes": materialised, "seed_materialised_float16_bytes": seed_bytes,
        "limit_bytes": LIMIT, "under_limit": peak < LIMIT,
        "wall_s": wall, "stats_total_s": sum(r["stats_s"] for r in rows),
        "sdpa_forward_total_s": sum(r["sdpa_forward_s"] for r in rows),
        "ratio_to_sdpa_median": statistics.median(r["ratio_to_sdpa"] for r in rows),
        "method_comparison": comparison,
        "per_layer": rows,
        "headlab": headlab.__version__,
    }
    print()
    print(f"{'':34s}{'bytes':>16s}{'':4s}human")
    print(f"{'materialise every map (float16)':34s}{materialised:16,d}    {human_bytes(materialised)}")
    if materialised != seed_bytes:
        print(f"{'  (the full 32 x 32 x 4096 seed)':34s}{seed_bytes:16,d}    {human_bytes(seed_bytes)}")
    print(f"{'peak RSS of this process':34s}{peak:16,d}    {human_bytes(peak)}"
          f"   ({peak / materialised:.1%} of the maps; limit {human_bytes(LIMIT)}: "
          f"{'ok' if peak < LIMIT else 'EXCEEDED'})")
    print(f"{'  of which growth during the run':34s}{growth:16,d}    {human_bytes(growth)}")
    print(f"{'statistics kept (all layers)':34s}{kept_bytes:16,d}    {human_bytes(kept_bytes)}")
    print(f"time: {wall:.0f} s in all; statistics {result['stats_total_s']:.0f} s, sdpa forward "
          f"{result['sdpa_forward_total_s']:.0f} s; median time / sdpa {result['ratio_to_sdpa_median']:.2f}")
    if comparison:
        print(f"methods on {', '.join(SDPA_STATS)} ({comparison['layers']} layers, median per layer): "
              f"tiled {comparison['tiled_s']:.2f} s, sdpa {comparison['sdpa_method_s']:.2f} s, "
              f"sdpa forward alone {comparison['sdpa_forward_s']:.2f} s -> {comparison['faster']} is faster")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
