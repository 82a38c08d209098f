"""KV cache per head on SmolLM2-135M: memory against passkey retrieval and perplexity, for six policy families.

Policies (every non-full one windows its heads to 4 sink tokens + the last 256, StreamingLLM's shape):

- ``full``: the ordinary cache;
- ``streaming``: every kv head windowed (StreamingLLM, Xiao et al. 2024), at recent = 256 and 1024;
- ``atlas split``: DuoAttention's split (Xiao et al. 2024): the kv heads whose attention a window would lose
  most (1 - sink - local mass, plus the retrieval score, from ``headlab.atlas`` on UD-EWT *train* text) full;
- ``retrieval``: Wu et al. 2024's retrieval score alone; ``importance``: Michel et al. 2019's head importance
  (language-model loss on UD-EWT train sentences); ``random``: the control (seeded);
  at the first of ``--budgets`` (the share of kv heads kept full; the atlas split at each);
- ``pruned + split``: the least important kv groups removed physically (``headlab.prune_heads``), then the
  atlas split on what remains.

Measured: passkey retrieval (a 5-digit key hidden in filler text at ``--depths``, asked for at the end; greedy;
exact match) at ``--lengths``; perplexity of ``--ppl-tokens`` tokens of concatenated UD English-EWT *dev*
documents (one forward with the policy's per-head visibility, which equals decoding it token by token);
KV bytes (measured, peak) and decode time per token at ``--time-lengths``. Prints the table, writes
``results/kv.json`` and the Pareto plot ``results/kv_pareto.png``.

    python benchmarks/bench_kv.py --no-time               # the README's grid (about 30 minutes on 2 cores, idle)
    python benchmarks/bench_kv.py --time-only             # decode and prefill time at 2k, 4k, 8k (2 minutes)
    python benchmarks/bench_kv.py --lengths 1024 --depths 50 --budgets 0.25 --time-lengths 1024 --ppl-tokens 1024
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

import headlab  # noqa: E402
from headlab import kv  # noqa: E402
from headlab.decode import generate, perplexity  # noqa: E402
from headlab.decode.calibrate import window_loss  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "ud-english-ewt"
REST = kv.window(4, 256)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")
# published figures, for the table (not measured here)
PUBLISHED = [
    ("DuoAttention (Xiao et al. 2024), MHA models", "up to 2.55x less KV memory, 2.18x faster decoding, "
     "accuracy within 1 point of full attention on needle-in-a-haystack"),
    ("DuoAttention (Xiao et al. 2024), GQA models", "up to 1.67x less KV memory, 1.50x faster decoding"),
    ("StreamingLLM (Xiao et al. 2024)", "4 sinks + window: stable perplexity to 4M tokens, but only what is in "
     "the window can be retrieved (passkey beyond the window fails)"),
]


def documents(path: Path) -> list[str]:
    """The documents of a CoNLL-U file, each its sentences' ``# text`` joined."""
    docs, cur = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# newdoc") and cur:
            docs.append(" ".join(cur))
            cur = []
        elif line.startswith("# text = "):
            cur.append(line[len("# text = "):])
    if cur:
        docs.append(" ".join(cur))
    return docs


def passkey_prompt(tok, n_tokens: int, depth: float, key: int) -> torch.Tensor:
    """``(1, ~n_tokens)`` ids: the intro, filler with the key's sentence at ``depth`` of it, the question."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    ask = "\nWhat is the pass key? The pass key is"
    fixed = len(tok(INTRO + needle + ask)["input_ids"])
    per = len(tok(FILLER)["input_ids"])
    reps = max(1, (n_tokens - fixed) // per)
    before = round(reps * depth)
    text = INTRO + FILLER * before + needle + FILLER * (reps - before) + ask
    return tok(text, return_tensors="pt")["input_ids"]


def passkey(lm, policy, lengths, depths, trials: int, seed: int) -> dict:
    rng = random.Random(seed)
    hits, rows = 0, []
    for n in lengths:
        for d in depths:
            for _ in range(trials):
                key = rng.randint(10000, 99999)
                ids = passkey_prompt(lm.tokenizer, n, d / 100, key)
                g = generate(lm, ids, policy=policy, max_new_tokens=16)  # digits are single tokens
                got = re.findall(r"\d{5}", g.text or "")
                ok = bool(got) and got[0] == str(key)
                hits += ok
                rows.append({"tokens": ids.shape[1], "depth": d, "key": key, "answer": (g.text or "").strip(),
                             "ok": ok, "kv_bytes": g.kv_bytes, "kv_bytes_full": g.kv_bytes_full})
    return {"accuracy": hits / len(rows), "trials": rows}


def policies(lm, budgets, atlas_scores, importance, prune_share: float, calibrated) -> list[tuple[object, kv.Policy]]:
    """``[(model, policy)]``: the model is ``lm`` except for the pruned policy."""
    out = [(lm, kv.Policy.from_scores(lm, calibrated, keep=b, rest=REST, name=f"passkey-calibrated {b:.0%} full"))
           for b in budgets] + [(lm, kv.Policy.uniform("full")), (lm, kv.Policy.uniform(REST)),
           (lm, kv.Policy.uniform(kv.window(4, 1024)))]
    for i, b in enumerate(budgets):
        out.append((lm, kv.Policy.from_atlas(lm, atlas_scores, keep=b, rest=REST)))
        if i > 0:  # the other rankers at the first budget only: the grid fits the machine
            continue
        if "retrieval" in atlas_scores:
            out.append((lm, kv.Policy.from_scores(lm, atlas_scores["retrieval"], keep=b, rest=REST,
                                                  name=f"retrieval {b:.0%} full")))
        out.append((lm, kv.Policy.from_importance(lm, importance, keep=b, rest=REST)))
        out.append((lm, kv.Policy.random(lm, keep=b, rest=REST, seed=0)))
    if prune_share > 0:
        out.append(pruned_split(lm, atlas_scores, importance, prune_share, budgets[0]))
    return out


def pruned_split(lm, atlas_scores, importance, share: float, keep: float):
    """Remove the ``share`` least important kv groups (all their query heads) physically, then split the rest."""
    H, G = lm.adapter.layer_heads[0], lm.adapter.layer_kv_heads[0]
    rep = H // G
    groups = sorted(((float(importance[l, j * rep:(j + 1) * rep].sum()), l, j)
                     for l in range(len(lm.adapter.layer_heads)) for j in range(G)))
    n = round(share * len(groups))
    drop: dict[int, list[int]] = {}
    for _, l, j in groups:
        if len(drop) and sum(len(v) for v in drop.values()) >= n * rep:
            break
        if len(drop.get(l, [])) + rep >= H:  # never a whole layer
            continue
        drop.setdefault(l, []).extend(range(j * rep, (j + 1) * rep))
    pruned = headlab.prune_heads(lm, drop)
    kept = {l: [h for h in range(H) if h not in set(drop.get(l, []))] for l in range(len(lm.adapter.layer_heads))}
    scores = {k: torch.stack([torch.nn.functional.pad(v[l, kept[l]], (0, H - len(kept[l])), value=-1.0)
                              for l in range(v.shape[0])]) for k, v in atlas_scores.items()}
    pol = kv.Policy.from_atlas(pruned, scores, keep=keep, rest=REST)
    removed = sum(len(v) for v in drop.values()) // rep
    return pruned, kv.Policy(pol.rules, pol.default, f"pruned {removed} kv heads + split {keep:.0%} full")


def decode_time(lm, policy, n: int, text_ids: torch.Tensor, new: int) -> dict:
    ids = text_ids[:, :n - new]  # the prompt and the new tokens fill n positions (SmolLM2 reads 8,192)
    g = generate(lm, ids, policy=policy, max_new_tokens=new, stop_at_eos=False)
    return {"tokens": n, "kv_bytes": g.kv_bytes, "kv_bytes_full": g.kv_bytes_full,
            "seconds_per_token": g.decode_seconds / max(1, g.ids.shape[1] - 1), "prefill_seconds": g.prefill_seconds}


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        x = r["kv_share_4k"]
        for ax, key in zip(axes, ("passkey", "perplexity")):
            ax.scatter(x, r[key], s=30)
            ax.annotate(r["policy"], (x, r[key]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    axes[0].set_ylabel("passkey accuracy")
    axes[1].set_ylabel("perplexity (UD-EWT dev)")
    for ax in axes:
        ax.set_xlabel("KV cache at 4k tokens, share of the full cache")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    fig.suptitle("SmolLM2-135M: KV memory vs passkey retrieval and perplexity, per-head policies")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096", help="passkey prompt lengths in tokens")
    ap.add_argument("--depths", default="10,50,90", help="needle depths in percent")
    ap.add_argument("--trials", type=int, default=1, help="keys per (length, depth)")
    ap.add_argument("--budgets", default="0.25,0.4,0.6", help="share of kv heads kept full by the ranked policies")
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="tokens of UD-EWT dev text for perplexity")
    ap.add_argument("--time-lengths", default="2048,4096,8192", help="cache lengths for time per decoded token")
    ap.add_argument("--prune-share", type=float, default=0.1, help="kv heads removed physically (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long", default="", help="also passkey at these lengths (e.g. 8192), for full, streaming and "
                    "the atlas split only (a prefill at 8k takes minutes on 2 cores)")
    ap.add_argument("--window", default="4,256", help="SINK,RECENT of the windowed heads in every ranked policy")
    ap.add_argument("--only", default="", help="run only the policies whose names start with these (comma-separated); "
                    "their rows replace those of the same name in results/kv.json")
    ap.add_argument("--rescore", action="store_true", help="compute the head scores again (else results/kv_scores.json)")
    ap.add_argument("--no-time", action="store_true", help="skip the decode timing (run it alone on a quiet machine)")
    ap.add_argument("--time-name", default="kv_time", help="results/NAME.json for the decode timing")
    ap.add_argument("--time-only", action="store_true", help="only the decode timing (needs the scores: reads "
                    "results/kv_scores.json for the atlas split)")
    args = ap.parse_args(argv)
    global REST
    REST = kv.window(*(int(x) for x in args.window.split(",")))
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [int(x) for x in args.depths.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    if not DATA.is_dir():
        sys.exit(f"UD English-EWT not found at {DATA} (the benchmark reads it by path)")
    torch.manual_seed(args.seed)
    lm = headlab.load("smollm2")
    dev_ids = lm.tokenizer(" ".join(documents(DATA / "en_ewt-ud-dev.conllu")), return_tensors="pt")["input_ids"]
    if args.time_only:
        import json

        saved = json.loads((Path(__file__).resolve().parent / "results" / "kv_scores.json").read_text())
        scores = {k: torch.tensor(v) for k, v in saved["atlas_scores"].items()}
        timing(lm, args, dev_ids, kv.Policy.from_atlas(lm, scores, keep=budgets[0], rest=REST))
        return
    t0 = time.perf_counter()
    scores_file = Path(__file__).resolve().parent / "results" / "kv_scores.json"
    if scores_file.is_file() and not args.rescore:
        import json

        saved = json.loads(scores_file.read_text())
        print(f"head scores from {scores_file} (--rescore to compute them again)", flush=True)
        atlas_scores = {k: torch.tensor(v) for k, v in saved["atlas_scores"].items()}
        importance = torch.tensor(saved["importance"])
        calibrated = torch.tensor(saved["window_loss"]) if "window_loss" in saved else None
    else:
        train = documents(DATA / "en_ewt-ud-train.conllu")
        print("scoring heads: atlas (sink, local w=256, retrieval) and importance on UD-EWT train ...", flush=True)
        long_docs = [d for d in train if len(d) > 4000][:4]
        at = headlab.atlas(lm, kinds=["sink", "local", "retrieval"], texts=long_docs, checks=False, window=256,
                           max_tokens=1024, n_texts=4)
        atlas_scores = {k: at.scores[k] for k in ("sink", "local", "retrieval") if k in at.scores}
        t_atlas = time.perf_counter() - t0
        imp = headlab.head_importance(lm, [d[:2000] for d in train[:24]], loss="lm", batch_size=4)
        importance = getattr(imp, "scores", imp)
        calibrated = None
        saved = {"atlas_scores": {k: v.tolist() for k, v in atlas_scores.items()}, "importance": importance.tolist(),
                 "atlas_seconds": t_atlas, "importance_seconds": time.perf_counter() - t0 - t_atlas}
    if calibrated is None:
        t1 = time.perf_counter()
        print("calibrating: the mass a 4+256 window evicts at the answer rows of 4 synthetic passkey prompts ...",
              flush=True)
        rng = random.Random(args.seed + 100)  # other keys than the evaluation's
        prompts = [passkey_prompt(lm.tokenizer, 2048, d, rng.randint(10000, 99999)) for d in (0.2, 0.4, 0.6, 0.8)]
        calibrated = window_loss(lm, prompts, REST, rows=8)
        saved = {**saved, "window_loss": calibrated.tolist(), "calibration_seconds": time.perf_counter() - t1}
        saved.pop("machine", None)
        write_json("kv_scores", saved)
    t_scores = time.perf_counter() - t0
    print(f"  scored in {t_scores:.0f} s", flush=True)
    rows = []
    full_kvh = lm.adapter.layer_kv_heads

    def share(pol, kvh, n):
        return (headlab.costs.policy_cache_bytes(pol, kv_heads=kvh, tokens=n, head_dim=64)
                / headlab.costs.full_cache_bytes(layers=len(full_kvh), kv_heads=full_kvh[0], tokens=n, head_dim=64))

    todo = policies(lm, budgets, atlas_scores, importance, args.prune_share, calibrated)
    if args.window != "4,256":  # name the window where it is not the default
        todo = [(m, p if p.name.startswith(("full", "streaming")) else
                 kv.Policy(p.rules, p.default, f"{p.name} (window {REST.sink}+{REST.recent})")) for m, p in todo]
    if args.only:
        todo = [(m, p) for m, p in todo if any(p.name.startswith(o) for o in args.only.split(","))]
    for model, pol in todo:
        t = time.perf_counter()
        pk = passkey(model, pol, lengths, depths, args.trials, args.seed)
        ppl = perplexity(model, dev_ids[:, :args.ppl_tokens], policy=pol)
        kvh = model.adapter.layer_kv_heads
        longest = max(r["tokens"] for r in pk["trials"])
        measured = [r["kv_bytes"] / r["kv_bytes_full"] for r in pk["trials"] if r["tokens"] == longest]
        rows.append({"policy": pol.name, "heads": pol.counts(kvh), "passkey": pk["accuracy"], "perplexity": ppl,
                     "kv_share_4k": share(pol, kvh, 4096), "kv_share_8k": share(pol, kvh, 8192),
                     "kv_share_measured_longest": max(measured), "passkey_trials": pk["trials"],
                     "seconds": time.perf_counter() - t})
        r = rows[-1]
        if args.long and (pol.name in ("full", "streaming 4+256") or pol.name.startswith("atlas split")):
            r["passkey_long"] = passkey(model, pol, [int(x) for x in args.long.split(",")], depths, args.trials,
                                        args.seed + 1)
            r["seconds"] = time.perf_counter() - t
            print(f"  {pol.name}: passkey at {args.long} tokens {r['passkey_long']['accuracy']:.2f}", flush=True)
        print(f"{pol.name:<34} passkey {pk['accuracy']:.2f}  ppl {ppl:7.3f}  KV {r['kv_share_4k']:6.1%} of full at 4k "
              f"({r['kv_share_8k']:.1%} at 8k; measured {r['kv_share_measured_longest']:.1%} at {longest} tokens)  "
              f"[{r['seconds']:.0f} s]", flush=True)
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    if args.only and (out / "kv.json").is_file():  # merge: this run's rows replace the same policies' rows
        import json

        names = {r["policy"] for r in rows}
        earlier = json.loads((out / "kv.json").read_text())["policies"]
        rows = [r for r in earlier if r["policy"] not in names] + rows
    plot(rows, out / "kv_pareto.png")
    path = write_json("kv", {"args": vars(args), "scoring_seconds": t_scores, "policies": rows,
                             "published": PUBLISHED})
    print(f"\n{'policy':<34} {'KV@4k':>7} {'KV@8k':>7} {'passkey':>8} {'long':>6} {'ppl':>8}")
    for r in rows:
        long = f"{r['passkey_long']['accuracy']:6.2f}" if "passkey_long" in r else f"{'-':>6}"
        print(f"{r['policy']:<34} {r['kv_share_4k']:7.1%} {r['kv_share_8k']:7.1%} {r['passkey']:8.2f} {long} "
              f"{r['perplexity']:8.3f}")
    print("\npublished, for comparison (not measured here):")
    for who, what in PUBLISHED:
        print(f"  {who}: {what}")
    print(f"wrote {path} and {out / 'kv_pareto.png'} ({time.perf_counter() - t0:.0f} s in all)")
    if not args.no_time:
        timing(lm, args, dev_ids, kv.Policy.from_atlas(lm, atlas_scores, keep=budgets[0], rest=REST))


def timing(lm, args, dev_ids, split) -> None:
    """Decode time per token and KV bytes at each ``--time-lengths``: full, streaming, the atlas split and KIVI
    4-bit on every head (whose decode reads its quantized keys back through a dequantization each step)."""
    lengths = [int(x) for x in args.time_lengths.split(",")]
    text_ids = torch.cat([dev_ids] * (1 + max(lengths) // dev_ids.shape[1]), 1)
    table = {}
    generate(lm, text_ids[:, :64], max_new_tokens=3)  # warm up (the first calls pay for kernels and caches)
    for n in lengths:
        table[n] = {name: decode_time(lm, pol, n, text_ids, 17) for name, pol in
                    (("full", kv.Policy.uniform("full")), ("streaming", kv.Policy.uniform(REST)), ("split", split),
                     ("full 4-bit", kv.Policy.uniform(kv.full(bits=4))))}
        f = table[n]["full"]
        print(f"decode at {n}: " + ", ".join(
            f"{k} {v['seconds_per_token'] * 1e3:.1f} ms/token ({v['seconds_per_token'] / f['seconds_per_token']:.2f}x "
            f"full; prefill {v['prefill_seconds']:.1f} s = {v['prefill_seconds'] / f['prefill_seconds']:.2f}x; "
            f"KV {v['kv_bytes'] / v['kv_bytes_full']:.1%})" for k, v in table[n].items()), flush=True)
    path = write_json(args.time_name, {"args": vars(args), "split": split.name, "decode_time": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
