"""SmolLM2-135M sharded over 3 gloo ranks against one process: what each rank holds, analyze's statistics, IOI
patching, the head atlas with its causal checks, and a memory cap (issue 32's done-when).

SmolLM2 has 9 query heads on 3 kv heads, so transformers' plan needs 3 ranks (2 would cut a kv head). Under torchrun
each rank loads its shard (``headlab.load("smollm2", tensor_parallel=True)``) and runs, like one process: the map-free
statistics of every head on one sentence (what ``headlab analyze`` tabulates), and on 4 IOI prompts (Wang et al.
2022; the prompt builder of ``bench_ioi.py``) exact patching of every head's z and attribution patching. Rank 0 saves
the results; the second command runs one process on the same inputs and prints the largest differences.

    .venv/bin/torchrun --nproc_per_node 3 benchmarks/bench_tp_smollm2.py   # the sharded run (gloo, CPU)
    .venv/bin/python benchmarks/bench_tp_smollm2.py --one                  # one process, and the comparison

Writes ``benchmarks/results/tp_smollm2.json``: per rank its parameters (attention and MLP), load and work time and
peak RSS, beside one process's, and the largest |sharded - one| of each figure.

``--parts`` chooses what runs (default ``analyze``, the part above); the same parts go to both commands, sharded
first. Run one part per command when its peak RSS matters (a process's peak covers every part it ran).

- ``atlas`` (``bench_tp_smollm2_atlas.py``): ``headlab.atlas`` with previous-token and induction, their causal checks
  and the OV copying score; every rank's scores, checks and verdicts against one process's, head by head
  (``results/tp_smollm2_atlas.json``);
- ``cap`` (``bench_tp_smollm2_cap.py``): ``HEADLAB_MEMORY_LIMIT=--cap`` (default 384MiB), between one process's
  weights and a rank's: the 3 ranks load and capture analyze's statistics, one process is refused with the estimate
  before reading a weight (``results/tp_smollm2_cap.json``).

    .venv/bin/torchrun --nproc_per_node 3 benchmarks/bench_tp_smollm2.py --parts atlas
    .venv/bin/python benchmarks/bench_tp_smollm2.py --one --parts atlas
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, write_json  # noqa: E402
from bench_tp_capture import _numel  # noqa: E402  (a DTensor counts its local shard)

TEXT = "The quick brown fox jumps over the lazy dog because it was late for dinner."
SAVED = RESULTS / "tp_smollm2_figures.pt"


def params(lm) -> dict:
    named = list(lm.model.named_parameters())
    return {"params_M": sum(_numel(p) for _, p in named) / 1e6,
            "attention_M": sum(_numel(p) for n, p in named if "self_attn" in n) / 1e6,
            "mlp_M": sum(_numel(p) for n, p in named if ".mlp." in n) / 1e6}


def work(lm) -> tuple[dict, dict]:
    """The figures (stats, patching) and the seconds each took; the same calls on every rank."""
    import headlab
    from headlab.interpret.patching import attribution_patch, patch
    from headlab.interpret.patching.prompts import prompt_pair
    from bench_ioi import prompts

    out, secs = {}, {}
    t = time.perf_counter()
    st = headlab.capture(lm, lm.encode(TEXT), ["blocks.*.attn.stats"])
    out.update({f"{k}.{f}": v for k, s in st.items() for f, v in s.as_dict().items() if torch.is_tensor(v)})
    secs["statistics"] = time.perf_counter() - t
    quads = prompts(lm.tokenizer, 4)
    clean, corrupt, io, s = (list(x) for x in zip(*quads))
    a, b, metric = prompt_pair(lm, clean, corrupt, [" " + w for w in io], [" " + w for w in s])
    t = time.perf_counter()
    exact = patch(lm, a, b, metric, sites="z")
    secs["exact_patching"] = time.perf_counter() - t
    t = time.perf_counter()
    attr = attribution_patch(lm, a, b, metric, sites="z")
    secs["attribution_patching"] = time.perf_counter() - t
    out["ioi_exact_z"] = exact.effects["z"]
    out["ioi_attribution_z"] = attr.effects["z"]
    out["ioi_logit_diff"] = torch.tensor([exact.clean, exact.corrupted])
    return out, secs


def row(lm, t_load: float, secs: dict) -> dict:
    return {**params(lm), "load_s": t_load, **{f"{k}_s": v for k, v in secs.items()},
            "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def sharded() -> None:
    import torch.distributed as dist

    import headlab

    t0 = time.perf_counter()
    lm = headlab.load("smollm2", tensor_parallel=True)
    t_load = time.perf_counter() - t0
    figs, secs = work(lm)
    r = {"rank": int(os.environ["RANK"]), "heads": list(lm.adapter.tp.heads()), **row(lm, t_load, secs)}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, r)
    if r["rank"] == 0:
        torch.save(figs, SAVED)
        for x in rows:
            print(f"rank {x['rank']}: heads {x['heads']}, {x['params_M']:.1f}M parameters ({x['attention_M']:.2f}M "
                  f"attention, {x['mlp_M']:.2f}M MLP), load {x['load_s']:.1f} s, statistics {x['statistics_s']:.2f} s, "
                  f"exact patching {x['exact_patching_s']:.1f} s, attribution {x['attribution_patching_s']:.2f} s, "
                  f"peak RSS {x['peak_rss_MiB']:.0f} MiB", flush=True)
        write_json("tp_smollm2", {"world": dist.get_world_size(), "text": TEXT, "ioi_prompts": 4, "ranks": rows})


def one() -> None:
    import headlab

    t0 = time.perf_counter()
    lm = headlab.load("smollm2")
    t_load = time.perf_counter() - t0
    figs, secs = work(lm)
    r = row(lm, t_load, secs)
    tp = torch.load(SAVED)
    worst = {k: float((figs[k].double() - tp[k].double()).abs().nan_to_num(0).max()) for k in tp}
    groups = {"statistics": max(v for k, v in worst.items() if ".attn.stats." in k),
              **{k: v for k, v in worst.items() if k.startswith("ioi_")}}
    print(f"one process: {r['params_M']:.1f}M parameters ({r['attention_M']:.2f}M attention, {r['mlp_M']:.2f}M MLP), "
          f"statistics {r['statistics_s']:.2f} s, exact patching {r['exact_patching_s']:.1f} s, attribution "
          f"{r['attribution_patching_s']:.2f} s, peak RSS {r['peak_rss_MiB']:.0f} MiB")
    print("largest |sharded - one|: " + ", ".join(f"{k} {v:.1e}" for k, v in groups.items()))
    doc = json.loads((RESULTS / "tp_smollm2.json").read_text())
    doc.pop("machine", None)
    write_json("tp_smollm2", {**doc, "one_process": r, "largest_difference": groups})


if __name__ == "__main__":
    import bench_tp_smollm2_atlas as atlas_part
    import bench_tp_smollm2_cap as cap_part

    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--one", action="store_true", help="the one-process peer and the comparison")
    ap.add_argument("--parts", nargs="+", choices=["analyze", "atlas", "cap"], default=["analyze"],
                    help="what to run (default: analyze, the statistics and IOI patching)")
    ap.add_argument("--cap", default=cap_part.CAP, help="HEADLAB_MEMORY_LIMIT of the cap part (default %(default)s)")
    args = ap.parse_args()
    for part in dict.fromkeys(args.parts):
        if part == "analyze":
            one() if args.one else sharded()
        elif part == "atlas":
            atlas_part.one() if args.one else atlas_part.sharded()
        else:
            cap_part.one(args.cap) if args.one else cap_part.sharded(args.cap)
