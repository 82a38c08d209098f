"""Heads that track dependency relations (Clark et al. 2019) on the UD English-EWT dev set, per model.

    nice -n 5 .venv/bin/python benchmarks/bench_probe_ewt.py                      # minilm and smollm2, 2,001 sentences
    nice -n 5 .venv/bin/python benchmarks/bench_probe_ewt.py --models minilm --limit 200 --out /tmp/probe
    nice -n 5 .venv/bin/python benchmarks/bench_probe_ewt.py --models minilm --keep smollm2 --out /tmp/probe

For each relation: the best head of each model with its accuracy and the best fixed-offset baseline,
beside Clark et al.'s BERT-base figures (2019, "What Does BERT Look At? An Analysis of BERT's
Attention", Table 1: WSJ Penn Treebank, Stanford Dependencies; UD's obj is their dobj, case their
prep, compound their nn, nmod:poss their poss, aux:pass their auxpass, compound:prt their prt). An
encoder is shown in its better direction; a decoder in the direction it can see (dep->head when
the head comes first, head->dep when a dependent does). Each model is timed (wall clock and CPU
seconds of the process, model loading apart) against the issue's bound: under 5 minutes on 2 cores.
Writes benchmarks/results/probe_ewt.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, write_json  # noqa: E402

import headlab  # noqa: E402
from headlab.interpret.probing.render import CLARK_TABLE1, prepare_out_dir, write_outputs  # noqa: E402

DEV = Path("/work/shared/data/ud-english-ewt/en_ewt-ud-dev.conllu")
BOUND_S = 300.0
EXTRA_MIN_COUNT = 100  # other relations shown when they have this many cases


def _shown(r, relation):
    """The best head in the direction worth showing (see the module docstring)."""
    direction = r.seen_direction(relation)
    return r.best_head(relation, direction)


def run(name: str, limit: int | None, out: Path | None) -> tuple[dict, object]:
    t0 = time.perf_counter()
    loaded = headlab.load(name)
    load_s = time.perf_counter() - t0
    c0, w0 = time.process_time(), time.perf_counter()
    last = [0.0]

    def progress(stage, done, total):
        now = time.perf_counter()
        if now - last[0] > 15 or done == total:
            last[0] = now
            print(f"  {name}: {stage} {done}/{total} ({now - w0:.0f} s)", file=sys.stderr, flush=True)

    r = headlab.probe(loaded, DEV, limit=limit, progress=progress)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    if out is not None:
        write_outputs(r, prepare_out_dir(out / name, force=True))
    entry = {
        "model": r.model, "family": r.family, "causal": r.causal, "layers": r.n_layers, "heads": r.n_heads,
        "sentences": r.sentences, "tokens": r.tokens, "skipped": len(r.skipped),
        "skipped_reasons": sorted({s.reason.split(":")[0][:60] for s in r.skipped})[:10],
        "load_s": round(load_s, 1), "probe_wall_s": round(wall, 1), "probe_cpu_s": round(cpu, 1),
        "load_avg_1min_after": os.getloadavg()[0], "under_5_min": wall < BOUND_S,
        "grad_note": r.grad_note, "head_map_sentences": r.head_map_sentences, "notes": r.notes,
        "best_heads": [{**b.__dict__, "margin": round(b.margin, 4)} for b in r.best_heads],
        "per_layer": [x.__dict__ for x in r.per_layer],
        "heads_beating_baseline": len(r.heads_beating_baseline()),
        "heads_beating_baseline_by_10_points_on_100_cases": len(r.heads_beating_baseline(min_margin=0.1, min_count=100)),
    }
    return entry, r


def table(results: dict) -> list[str]:
    names = list(results)
    first = next(iter(results.values()))
    extra = [rel for rel in first.relation_names if rel not in CLARK_TABLE1
             and first.count[0, first.relation_names.index(rel)] >= EXTRA_MIN_COUNT]
    head = f"{'relation':<13} {'Clark BERT-base (T1)':<24}" + "".join(f" {n + ' best head, acc vs base':<40}" for n in names)
    lines = [head, "-" * len(head)]
    for rel in [*CLARK_TABLE1, *extra]:
        sd = CLARK_TABLE1.get(rel)
        cells = f"{rel:<13} " + (f"{sd[0]:>7} {sd[1]:>5} {sd[2]:5.1f} vs {sd[3]:4.1f}" if sd else " " * 24)
        for n in names:
            r = results[n]
            if rel not in r.relation_names:
                cells += f" {'(no cases)':<40}"
                continue
            b = _shown(r, rel)
            cells += f" {b.direction:>9} {b.layer:>2}-{b.head:<2} {100 * b.accuracy:5.1f} vs {100 * b.baseline_accuracy:4.1f} " \
                     f"({b.baseline_offset:+d}) n={b.count:<5}"
        lines.append(cells)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm,smollm2")
    ap.add_argument("--limit", type=int, default=None, help="sentences (default: all 2,001)")
    ap.add_argument("--out", type=Path, default=None, help="also write each model's CSV/JSON/PNGs/HTML here")
    ap.add_argument("--keep", default="", help="models not rerun: keep their entries from the existing "
                    "probe_ewt.json and their results from --out/NAME/relations.json (e.g. --keep smollm2)")
    args = ap.parse_args()
    if not DEV.is_file():
        sys.exit(f"needs the EWT dev set at {DEV}")
    entries, results = {}, {}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        print(f"probing {name} ...", file=sys.stderr, flush=True)
        entries[name], results[name] = run(name, args.limit, args.out)
        e = entries[name]
        print(f"{name}: {e['sentences']} sentences ({e['tokens']} tokens, {e['skipped']} skipped) in "
              f"{e['probe_wall_s']:.0f} s wall, {e['probe_cpu_s']:.0f} s CPU (load {e['load_s']:.0f} s; "
              f"1-min load average {e['load_avg_1min_after']:.1f}); under 5 min: {e['under_5_min']}", flush=True)
    kept = {}
    for name in [m.strip() for m in args.keep.split(",") if m.strip()]:
        if args.out is None:
            sys.exit("--keep needs --out (where the kept model's relations.json is)")
        from headlab.interpret.probing.probe_result import ProbeResult

        results[name] = ProbeResult.load(args.out / name / "relations.json")
        kept[name] = json.loads((RESULTS / "probe_ewt.json").read_text())["models"][name]
    entries.update(kept)
    print()
    print("\n".join(table(results)))
    print("\nClark et al. 2019, Table 1 (BERT-base, PTB/SD): best head, its accuracy vs the best offset baseline (%).")
    path = write_json("probe_ewt" if args.limit is None else "probe_ewt_tmp", {
        "treebank": str(DEV), "limit": args.limit,
        "clark_table1": {k: {"sd": v[0], "head": v[1], "accuracy": v[2], "baseline": v[3],
                             "source": "Clark et al. 2019, What Does BERT Look At?, Table 1"}
                         for k, v in CLARK_TABLE1.items()},
        "models": entries, "table": table(results)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
