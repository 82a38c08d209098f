"""A RULER-style suite on SmolLM2-135M under KV policies, with paired intervals (issue 42, item 4).

The tasks come from :mod:`headlab.decode.suite` (single, multi-key and multi-value needles, variable tracking,
common-word extraction, question answering over a passage), deterministic from ``--seed``, about ``--tokens`` tokens
each. Every policy answers the same tasks, query-agnostic: the context is the prefill a policy compresses, the
question comes after it (``headlab.generate(..., question=)``), greedy decoding. A task is right when every answer
is in the output. Against the first policy (the full cache), each other one gets McNemar's paired interval of the
difference of accuracies with its exact p-value, and a paired bootstrap interval of the difference of RULER's
per-task scores (share of answers found). Perplexity is on decoded tokens: a held-out continuation (sentences never
in any context) teacher-forced one token at a time after the prefill (:func:`headlab.decode.suite_stats.decoded_nll`),
for the first ``--ppl`` tasks, with a paired bootstrap interval of the relative change of perplexity.

Bytes are each generation's ``kv_bytes`` (the peak the cache held, its tensors counted; the model and cache are
float32) over ``kv_bytes_full`` (the full cache's at the same length), and the cost model's figure in 16-bit terms
(``policy_peak_bytes(dtype="float16") / full_cache_bytes(dtype="float16")``; for Ada-KV an even split of its layer
budget, the real split being the data's).

    python benchmarks/bench_kv_suite.py --n 48 --tokens 1024 --ppl 12
    python benchmarks/bench_kv_suite.py --policy full --policy full:bits=4 --policy "adakv:256,bits=4" --n 500
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

import headlab  # noqa: E402
from headlab import kv  # noqa: E402
from headlab.costs.kv import full_cache_bytes, policy_peak_bytes  # noqa: E402
from headlab.decode import suite  # noqa: E402
from headlab.decode.suite_stats import decoded_nll, mcnemar, paired_bootstrap  # noqa: E402

DEFAULT_POLICIES = ["full", "full:bits=4", "adakv:256,bits=4"]


def ids_of(tok, text: str) -> torch.Tensor:
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=48, help="tasks (the six kinds in turn)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ppl", type=int, default=12, help="tasks whose held-out continuation is scored")
    ap.add_argument("--continuation", type=int, default=64, help="tokens of held-out continuation")
    ap.add_argument("--policy", action="append", help="a policy text (repeat); the first is the baseline")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="kv_suite")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    texts = args.policy or DEFAULT_POLICIES
    policies = {t: (None if t == "full" else kv.Policy.parse(t)) for t in texts}
    lm = headlab.load("smollm2")
    tok = lm.tokenizer
    cfg = lm.model.config
    shape = dict(kv_heads=[cfg.num_key_value_heads] * cfg.num_hidden_layers,
                 head_dim=cfg.hidden_size // cfg.num_attention_heads)
    tasks = suite.make_suite(tok, args.n, tokens=args.tokens, seed=args.seed, continuation_tokens=args.continuation)
    right: dict[str, list[int]] = defaultdict(list)
    score: dict[str, list[float]] = defaultdict(list)
    ratio: dict[str, list[float]] = defaultdict(list)
    model16: dict[str, list[float]] = defaultdict(list)
    secs: dict[str, list[float]] = defaultdict(list)
    nll: dict[str, list[float]] = defaultdict(list)
    lengths: list[int] = []
    done: list[suite.Task] = []
    t_all = time.perf_counter()
    signal.signal(signal.SIGTERM, _stop)  # `kill PID` ends the run with the tasks done so far, paired
    try:
        for i, t in enumerate(tasks):
            run_task(lm, tok, t, i, args, policies, right, score, ratio, model16, secs, nll, shape)
            done.append(t)
            lengths.append(ids_of(tok, t.context).shape[1] + ids_of(tok, t.question).shape[1])
            so_far = " ".join(f"{n}:{sum(r[: len(done)])}/{len(done)}" for n, r in right.items())
            print(f"[{i + 1}/{len(tasks)}] {t.kind:18s} {lengths[-1]} tokens  {so_far}  "
                  f"{time.perf_counter() - t_all:.0f}s", flush=True)
    except KeyboardInterrupt:
        print(f"stopped after {len(done)} of {len(tasks)} tasks; the table covers those", flush=True)
    if not done:
        return
    for table in (right, score, ratio, model16, secs):
        for name in table:
            del table[name][len(done) :]
    for name in nll:
        del nll[name][min(len(done), args.ppl) :]
    tasks = done
    report(args, texts, tasks, lengths, right, score, ratio, model16, secs, nll, t_all)


def _stop(*_) -> None:
    raise KeyboardInterrupt


def run_task(lm, tok, t, i, args, policies, right, score, ratio, model16, secs, nll, shape) -> None:
    """One task under every policy: its answer, bytes and time (and its decoded perplexity among the first)."""
    ctx, q = ids_of(tok, t.context), ids_of(tok, t.question)
    for name, p in policies.items():
        t0 = time.perf_counter()
        g = headlab.generate(lm, ctx, question=q, policy=p, max_new_tokens=t.max_new_tokens)
        secs[name].append(time.perf_counter() - t0)
        right[name].append(int(t.correct(g.text)))
        score[name].append(t.score(g.text))
        ratio[name].append(g.kv_bytes / g.kv_bytes_full)
        held = ctx.shape[1] + q.shape[1] + len(g.ids[0]) - 1
        pol = p if p is not None else kv.Policy.uniform("full")
        model16[name].append(policy_peak_bytes(pol, prompt=ctx.shape[1], tokens=held, dtype="float16", **shape)
                             / full_cache_bytes(layers=len(shape["kv_heads"]), kv_heads=shape["kv_heads"][0],
                                                tokens=held, head_dim=shape["head_dim"], dtype="float16"))
        if i < args.ppl:
            cont = ids_of(tok, t.continuation)
            nll[name].append(float(decoded_nll(lm, ctx, cont, policy=p, question=q).mean()))


def report(args, texts, tasks, lengths, right, score, ratio, model16, secs, nll, t_all) -> None:
    """The table against the first policy, printed and written to ``benchmarks/results/{args.out}.json``."""
    base = texts[0]
    rows = []
    for name in texts:
        r = {"policy": name, "right": sum(right[name]), "n": len(tasks),
             "accuracy": sum(right[name]) / len(tasks), "ruler_score": statistics.mean(score[name]),
             "kv_bytes_vs_full_measured": statistics.mean(ratio[name]),
             "kv_bytes_vs_16bit_cost_model": statistics.mean(model16[name]),
             "seconds_per_task": statistics.mean(secs[name]),
             "by_kind": {k: sum(x for x, tk in zip(right[name], tasks) if tk.kind == k) for k in suite.KINDS}}
        if nll[name]:
            r["decoded_ppl"] = float(torch.tensor(nll[name]).mean().exp())
        if name != base:
            m = mcnemar(right[name], right[base])
            b = paired_bootstrap(score[name], score[base], seed=args.seed)
            r["vs_full"] = {"acc_diff": m.diff, "acc_ci95": [m.low, m.high], "n10": m.n10, "n01": m.n01,
                            "mcnemar_p": m.p_value, "score_diff": b.diff, "score_ci95": [b.low, b.high]}
            if nll[name]:
                d = paired_bootstrap(nll[name], nll[base], seed=args.seed)  # mean log-ppl difference per task
                r["vs_full"]["decoded_ppl_change"] = [math_exp(d.diff) - 1, math_exp(d.low) - 1, math_exp(d.high) - 1]
        rows.append(r)
    per_task = sum(statistics.mean(secs[n]) for n in texts)  # generation only, every policy
    print(f"\n{len(tasks)} tasks, {min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}), "
          f"{len(nll[base])} with decoded perplexity over {args.continuation} held-out tokens; "
          f"{time.perf_counter() - t_all:.0f}s in all")
    print("| policy | right | accuracy diff vs full (95% paired CI, McNemar p) | RULER score diff (bootstrap 95%) "
          "| KV bytes vs full, measured (fp32) | vs 16-bit, cost model | decoded ppl (change, 95%) | s/task |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        v = r.get("vs_full")
        acc = "baseline" if v is None else (f"{v['acc_diff']:+.1%} [{v['acc_ci95'][0]:+.1%}, {v['acc_ci95'][1]:+.1%}],"
                                            f" p={v['mcnemar_p']:.3f} ({v['n10']}:{v['n01']})")
        sc = "" if v is None else f"{v['score_diff']:+.3f} [{v['score_ci95'][0]:+.3f}, {v['score_ci95'][1]:+.3f}]"
        ppl = f"{r['decoded_ppl']:.3f}" if "decoded_ppl" in r else "-"
        if v is not None and "decoded_ppl_change" in v:
            c = v["decoded_ppl_change"]
            ppl += f" ({c[0]:+.2%} [{c[1]:+.2%}, {c[2]:+.2%}])"
        print(f"| {r['policy']} | {r['right']}/{r['n']} | {acc} | {sc} | {r['kv_bytes_vs_full_measured']:.1%} | "
              f"{r['kv_bytes_vs_16bit_cost_model']:.1%} | {ppl} | {r['seconds_per_task']:.1f} |")
    print("by kind:", {r["policy"]: r["by_kind"] for r in rows})
    full_size = 500 * per_task
    print(f"the issue's full size (500 tasks at 1k tokens, these {len(texts)} policies) at this run's "
          f"{per_task:.1f} s per task: about {full_size / 3600:.1f} hours; at 8k tokens at least 8x that")
    write_json(args.out, {"args": vars(args), "rows": rows, "lengths": lengths,
                          "seconds_per_task_all_policies": per_task})


def math_exp(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).exp())


if __name__ == "__main__":
    main()
