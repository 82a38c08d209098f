"""The attention-versus-saliency study on the SST-2 MiniLM classifier, beside Jain and Wallace 2019.

    nice -n 5 python benchmarks/bench_saliency_sst2.py [--limit N] [--out DIR] [--backend sdpa]

Runs ``headlab explain --dataset validation.tsv`` (GLUE's 872 SST-2 dev sentences) on the classifier
made by ``benchmarks/models/minilm_sst2.py``: every method, Kendall tau of attention with each one,
the permutation test, the adversarial-attention search and ERASER faithfulness with bootstrap
intervals. The per-instance records go to ``--out`` (default ``benchmarks/results/saliency_sst2/``,
``instances.json``); this script runs every row in one go (for a run to interrupt and resume, use
``headlab explain --dataset ... --out DIR`` and its ``--resume``). Prints the tables and writes
``benchmarks/results/saliency_sst2.json``.

Jain and Wallace's model is a one-layer BiLSTM with additive attention over its states, so their
figures are a reference point for the question, not a number this transformer should reproduce.
What they report for SST (Jain and Wallace 2019, NAACL, "Attention is not Explanation"):
see :data:`JAIN_WALLACE_SST` for the quoted values and where each comes from.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, write_json  # noqa: E402

DATA = next((p for p in (Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2",
                         Path("/work/shared/data/sst2")) if (p / "validation.tsv").is_file()),
            Path("/work/shared/data/sst2"))

# What Jain and Wallace 2019 publish for SST. Table 2 (Kendall tau between attention and each
# importance measure, BiLSTM encoder, mean +- std per gold class, and the share of instances whose
# correlation is significant) as transcribed in a public study note of the paper (16_appendix.md, found
# with the search tool's code index); no primary copy of the paper was at hand to check it against.
TABLE2 = "Table 2 (SST rows, BiLSTM), via a public study note of the paper; not checked against a primary copy"
JAIN_WALLACE_SST = {
    "source": "Jain and Wallace 2019, 'Attention is not Explanation', NAACL-HLT, pp. 3543-3556",
    "kendall_gradient": {"value": {"0": [0.40, 0.21, 0.59], "1": [0.38, 0.19, 0.58]},
                         "fields": "class: [mean, std, significant share]", "where": TABLE2},
    "kendall_loo": {"value": {"0": [0.34, 0.20, 0.47], "1": [0.33, 0.19, 0.47]},
                    "fields": "class: [mean, std, significant share]", "where": TABLE2},
    "adversarial_jsd_max": {"value": 0.69, "where": "the authors' NAACL 2019 slides, 'Result for Adversarial "
                            "Attention 0.69' (slideplayer.com/17114161); ln 2 = 0.693 is the largest JSD possible"},
}


def main(argv=None) -> int:
    from headlab.models import cache_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(cache_dir("minilm-sst2")))
    ap.add_argument("--dataset", type=Path, default=DATA / "validation.tsv")
    ap.add_argument("--out", type=Path, default=RESULTS / "saliency_sst2")
    ap.add_argument("--limit", type=int, default=None, help="only the first N sentences")
    ap.add_argument("--backend", default="sdpa")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--adversarial-steps", type=int, default=20)
    ap.add_argument("--no-counterfactual", action="store_true")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop starting new sentences after this long")
    ap.add_argument("--methods", default="attention,gradient,grad_x_input,integrated_gradients,leave_one_out",
                    help="comma-separated explain methods (default: the study's five; rollout, norm_rollout, "
                         "attention_norm, attention_flow too)")
    args = ap.parse_args(argv)
    if not (Path(args.model).expanduser() / "config.json").is_file():
        raise SystemExit(f"no classifier at {args.model}: run benchmarks/models/minilm_sst2.py first")
    import torch

    torch.set_num_threads(args.threads)
    from headlab.cli.app import console
    from headlab.cli.views.explain import render_study
    from headlab.interpret.saliency import StudyOptions, study

    opts = StudyOptions(backend=args.backend, adversarial_steps=args.adversarial_steps,
                        counterfactual=not args.no_counterfactual,
                        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()))
    t0 = time.perf_counter()
    r = study(args.model, args.dataset, args.out, limit=args.limit, options=opts,
              max_seconds=None if args.max_minutes is None else 60 * args.max_minutes)
    seconds = time.perf_counter() - t0
    render_study(r, console)
    tb = r.tables
    print("\nbeside Jain and Wallace 2019 (SST, BiLSTM + additive attention):")
    kt = tb.get("kendall", {})
    print(f"  Kendall tau per predicted class (this model) beside J&W's per gold class; {TABLE2}")
    for m, key in (("gradient", "kendall_gradient"), ("leave_one_out", "kendall_loo")):
        ours = kt.get(m, {})
        jw = JAIN_WALLACE_SST[key]["value"]
        for c in ("0", "1"):
            o = ours.get("by_class", {}).get(c, {})
            mean, std, sig = jw[c]
            print(f"  attention vs {m:<14} class {c}: this model {o.get('mean', float('nan')):.2f} +- "
                  f"{o.get('std', float('nan')):.2f}, significant {o.get('significant', float('nan')):.2f}"
                  f"   J&W: {mean:.2f} +- {std:.2f}, significant {sig:.2f}")
        print(f"  attention vs {m:<14} all:     this model {ours.get('mean', float('nan')):.2f} +- "
              f"{ours.get('std', float('nan')):.2f}, significant {ours.get('significant', float('nan')):.2f}")
    adv = tb.get("adversarial")
    if adv:
        jw = JAIN_WALLACE_SST["adversarial_jsd_max"]
        print(f"  adversarial max JSD (TVD <= {adv['tvd_budget']}): this model median {adv['max_jsd'].get('q50', 0):.3f}, "
              f"mean {adv['max_jsd'].get('mean', 0):.3f}   J&W: up to {jw['value']} ({jw['where']})")
    perm = tb.get("permutation")
    if perm:
        print(f"  permutation: median output TVD {perm['median_tvd'].get('q50', 0):.4f} (share of instances < 0.01: "
              f"{perm['share_below_0.01']:.2f})   J&W: 'counterfactual attentions often have no effect on model output'")
    path = write_json("saliency_sst2", {"model": args.model, "dataset": str(args.dataset), "instances": r.instances,
                                        "seconds_this_run": round(seconds, 1), "tables": tb,
                                        "jain_wallace_sst": JAIN_WALLACE_SST, "out": str(args.out)})
    print(f"wrote {path} ({r.instances} instances; {seconds / 60:.1f} min this run)")
    (args.out / "README.txt").write_text(json.dumps({"command": " ".join(sys.argv)}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
