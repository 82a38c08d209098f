"""Re-run, under other KV policies, the suite tasks on which two policies of finished ``headlab kv suite`` runs
disagreed: does a change to the cache give the baseline's answers back where the compared policy lost them?

The tasks are rebuilt from each result file's settings (model, seed, tokens, continuation; the suite is
deterministic from them) and decoded exactly as the suite decodes them (the question asked after the compressed
context, caches held in ``kv_dtype``), so a policy the files ran gives back their answers (the ``as recorded``
column checks it). Printed per policy: how many of the disagreeing tasks it gets right, on how many it answers as
the baseline did and on how many as the compared policy did.

``--rotate-values`` folds a normalised Hadamard matrix into each layer's ``v_proj`` (values are stored turned)
and ``o_proj`` (and turned back): the same model in exact arithmetic, whose cache quantizes rotated values
(QuaRot, Ashkboos et al. 2024).

    cd benchmarks/results
    python ../bench_kv_disagree.py kv_suite_500.json kv_suite_500_seed1.json \\
        --policies "full:bits=4,group=64,residual=0;full:bits=8,group=64,residual=0;window:4,100000,bits=4,group=64,residual=0"
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

import headlab  # noqa: E402
from headlab.decode import kv, suite  # noqa: E402
from headlab.decode.generate import generate  # noqa: E402
from headlab.decode.suite_instrument import policy_texts  # noqa: E402
from headlab.errors import ConfigError  # noqa: E402
from headlab.models.loaded_model import resolve  # noqa: E402


def rotate_values(model) -> None:
    """Fold a normalised Hadamard matrix ``H`` into every layer: ``v_proj`` gives ``v H`` per kv head, ``o_proj``
    takes ``out H`` per query head back (``H`` is symmetric and orthogonal), so the model computes the same."""
    for layer in model.model.layers:
        a = layer.self_attn
        d = a.head_dim
        h = torch.ones(1, 1)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = h / math.sqrt(d)
        with torch.no_grad():
            w = a.v_proj.weight
            w.copy_((h.T @ w.view(-1, d, w.shape[1])).reshape_as(w))
            o = a.o_proj.weight
            o.copy_((o.view(o.shape[0], -1, d) @ h).reshape_as(o))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="headlab kv suite result files (JSON)")
    ap.add_argument("--policies", required=True, help="the policies to re-run, separated by ';'")
    ap.add_argument("--compared", default=None, help="the policy of the files compared with the baseline (default: "
                                                      "the files' second)")
    ap.add_argument("--rotate-values", action="store_true", help="fold a Hadamard rotation into v_proj and o_proj")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="kv_disagree", help="results/<name>.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = []
    for p in args.results:  # refused before the model loads: a missing file, or one that is not a suite run
        try:
            r = json.loads(Path(p).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SystemExit(f"{p}: cannot read a headlab kv suite result ({exc})") from None
        if not isinstance(r, dict) or r.get("headlab", {}).get("kind") != "kv_suite" or "units" not in r:
            raise SystemExit(f"{p}: not a headlab kv suite result (write one with `headlab kv suite -o FILE`)")
        runs.append(r)
    for p in policy_texts(args.policies):
        try:
            kv.Policy.parse(p)  # an unknown rule or a bad item: its own message, before the load
        except ConfigError as exc:
            raise SystemExit(f"--policies: {exc}") from None
    settings = [r["headlab"]["settings"] for r in runs]
    if any(st != {**settings[0], "seed": st["seed"]} for st in settings):
        raise SystemExit("the result files differ in a setting other than the seed; give runs of one suite")
    texts = policy_texts(settings[0]["policies"])
    base, compared = texts[0], args.compared or texts[1]
    lm = headlab.load(settings[0]["model"])
    if args.rotate_values:
        rotate_values(resolve(lm)[0].model)
    tok = lm.tokenizer
    todo = []  # (run, task index, baseline right, compared right)
    recorded: list[dict] = []  # each task's recorded answers, by policy
    for ri, r in enumerate(runs):
        for key, unit in r["units"].items():
            a, b = unit["policies"][base]["right"], unit["policies"][compared]["right"]
            if a != b:
                todo.append((ri, int(key.split()[-1]), a, b))
                recorded.append({p: v["right"] for p, v in unit["policies"].items()})
    tasks = {}
    for ri, st in enumerate(settings):
        tasks[ri] = suite.make_suite(tok, st["n"], tokens=st["tokens"], seed=st["seed"],
                                     continuation_tokens=st["continuation"])
    policies = policy_texts(args.policies)
    got: dict[str, list[int]] = {p: [] for p in policies}
    t0 = time.time()
    for n, (ri, i, a, b) in enumerate(todo):
        t = tasks[ri][i]
        st = settings[ri]
        context = torch.tensor([tok(t.context, add_special_tokens=False)["input_ids"]])
        question = torch.tensor([tok(t.question, add_special_tokens=False)["input_ids"]])
        for p in policies:
            g = generate(lm, context, question=question, policy=None if p == "full" else kv.Policy.parse(p),
                         max_new_tokens=t.max_new_tokens, kv_dtype=st["kv_dtype"])
            got[p].append(int(t.correct(g.text)))
        if (n + 1) % 10 == 0 or n + 1 == len(todo):
            print(f"{n + 1}/{len(todo)} tasks, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = []
    for p in policies:
        right = got[p]
        rows.append({"policy": p, "right": sum(right),
                     "as_baseline": sum(x == a for x, (_, _, a, _) in zip(right, todo)),
                     "as_compared": sum(x == b for x, (_, _, _, b) in zip(right, todo)),
                     "as_recorded": sum(x == rec[p] for x, rec in zip(right, recorded)) if p in recorded[0] else None})
    print(f"{len(todo)} tasks on which {base!r} and {compared!r} disagree ({base} right on "
          f"{sum(a for _, _, a, _ in todo)}, {compared} on {sum(b for _, _, _, b in todo)})"
          + (", values rotated" if args.rotate_values else ""))
    print(f"{'policy':<48} {'right':>6} {'as ' + base:>12} {'as compared':>12} {'as recorded':>12}")
    for r in rows:
        rec = "" if r["as_recorded"] is None else r["as_recorded"]
        print(f"{r['policy']:<48} {r['right']:>6} {r['as_baseline']:>12} {r['as_compared']:>12} {rec:>12}")
    path = write_json(args.name, {"args": vars(args), "baseline": base, "compared": compared, "tasks": len(todo),
                                  "rows": rows, "units": [list(x) for x in todo], "right": got})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
