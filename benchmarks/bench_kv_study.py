"""KV study, round two, on SmolLM2-135M: passkey accuracy with 95% intervals, perplexity, bytes, decode time.

Every policy reads the same prompts (paired): ``--prompts`` passkey tests, half single-key (Mohtashami and
Jaggi 2023) and half multi-key (three labelled keys, one asked for, as RULER's multi-key needle, Hsieh et al.
2024), the asked key at depths 10, 30, 50, 70, 90% of the filler, at the ``--lengths`` cycled by ``--mix``.
Accuracy is exact match of the first five digits of a greedy answer; its 95% interval is Wilson's score
interval, and the difference from the full cache has a 95% interval from the paired bootstrap (the same
prompts resampled for both). Perplexity is over ``--ppl-tokens`` of UD English-EWT dev, the first half as one
prefill and the rest one token at a time (so quantized and SnapKV caches act on it as in decoding).

Bytes are against a **16-bit** full cache: ``headlab.costs.policy_cache_bytes`` at float16 (the cache here is
float32 on CPU; the measured share at the longest prompt is printed beside, and the tests hold the two equal).

Policies: the full cache; KIVI quantization alone (Liu et al. 2024; 8, 4, 2 bits); StreamingLLM (Xiao et al.
2024b; 4 sinks + 256); the learned split (DuoAttention, Xiao et al. 2024: gates from ``bench_kv_train.py``) at
50% of kv heads full, alone and on 4-bit KV; the training-free rankings at equal memory (atlas,
passkey-calibrated, retrieval, importance, random; scores from ``bench_kv.py``'s ``results/kv_scores.json``);
headlab's SnapKV; and, as a peer, NVIDIA's kvpress (StreamingLLMPress, SnapKVPress) at the same share, where it
imports (``--kvpress PATH``: a folder holding kvpress 0.5.5 and its small dependencies, installed with
``pip install --no-deps --target PATH kvpress==0.5.5 cachetools fire six termcolor``).

    python benchmarks/bench_kv_study.py                            # the README's table (about an hour, 2 cores)
    python benchmarks/bench_kv_study.py --only "full,trained*" --prompts 40
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402
from bench_kv import DATA, documents  # noqa: E402

import headlab  # noqa: E402
from headlab import kv  # noqa: E402
from headlab.decode import generate, passkey, perplexity  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# what the papers report, printed beside our table (their models and tasks, not SmolLM2's)
PAPER = [("KIVI, Liu et al. 2024", "2-bit keys per channel and values per token keep almost the same quality as a "
          "16-bit cache on Llama, Falcon and Mistral models (LongBench, passkey); 4-bit is near-lossless"),
         ("DuoAttention, Xiao et al. 2024", "a learned split keeps accuracy with 25% of heads full on MHA and 50% "
          "on GQA models: up to 2.55x (MHA) and 1.67x (GQA) less KV memory; stacked on 4-bit KV"),
         ("StreamingLLM, Xiao et al. 2024b", "4 sinks + a window keep perplexity stable; retrieval past the window "
          "is not kept"),
         ("kvpress (NVIDIA)", "presses evaluated with the question after the compression (query-agnostic)")]
REST = kv.window(4, 256)


def trials(n: int, lengths: list[int], mix: list[int], seed: int, kinds: str = "both") -> list[dict]:
    """The prompts every policy reads: ``n`` specs, alternating single- and multi-key (``kinds="both"``), or
    only one kind (``"single"``, ``"multi"``)."""
    rng = random.Random(seed)
    cycle = [L for L, w in zip(lengths, mix) for _ in range(w)]
    step = 2 if kinds == "both" else 1
    out = []
    for i in range(n):
        depth = (10, 30, 50, 70, 90)[(i // step) % 5] / 100
        tokens = cycle[(i // step // 5) % len(cycle)] if step == 1 else cycle[(i // 2) % len(cycle)]
        # a run of n prompts is the first n of a longer run
        if kinds == "single" or (kinds == "both" and i % 2 == 0):
            out.append({"tokens": tokens, "depths": [depth], "keys": passkey.draw_keys(1, rng), "labels": None,
                        "ask": 0})
        else:
            keys = passkey.draw_keys(3, rng)
            others = [rng.choice((0.1, 0.3, 0.5, 0.7, 0.9)) for _ in range(2)]
            out.append({"tokens": tokens, "depths": [depth] + others, "keys": keys,
                        "labels": rng.sample(passkey.LABELS, 3), "ask": 0})
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% score interval for ``k`` successes in ``n``."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def paired_diff(a: list[bool], b: list[bool], draws: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """Accuracy of ``a`` minus ``b`` on the same prompts, with a 95% paired-bootstrap interval."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    idx = torch.randint(0, len(x), (draws, len(x)), generator=g)
    means = x[idx].mean(1).sort().values
    return float(x.mean()), float(means[int(0.025 * draws)]), float(means[int(0.975 * draws) - 1])


def discordance(a: list[bool], b: list[bool]) -> tuple[int, int, float]:
    """Prompts where ``a`` misses and ``b`` retrieves, the reverse, and the upper end of the 95% Wilson interval of
    the share of prompts on which they disagree: a bound on |accuracy(a) - accuracy(b)| that holds even when
    they never disagree (where a bootstrap interval collapses to a point)."""
    worse = sum((not x) and y for x, y in zip(a, b))
    better = sum(x and not y for x, y in zip(a, b))
    return worse, better, wilson(worse + better, len(a))[1]


def share(oks: list[bool], specs: list[dict], single: bool) -> float | None:
    """Accuracy on the single-key (or the multi-key) prompts; None where there are none."""
    picked = [o for o, s in zip(oks, specs) if (s["labels"] is None) == single]
    return sum(picked) / len(picked) if picked else None


def run_headlab(lm, policy, p, question: bool):
    ids, tail = p.ids, (p.question if question else 0)
    if tail:
        g = generate(lm, ids[:, :-tail], question=ids[:, -tail:], policy=policy, max_new_tokens=8)
    else:
        g = generate(lm, ids, policy=policy, max_new_tokens=8)
    return g.text, g.kv_bytes / g.kv_bytes_full, g.decode_seconds / max(1, g.ids.shape[1] - 1)


class KVPress:
    """kvpress's presses on the same model: compress the context (the question after it), then decode greedily."""

    def __init__(self, lm, path: str):
        import types

        sys.modules.setdefault("datasets", types.SimpleNamespace(load_dataset=None))  # imported, unused here
        sys.path.insert(0, path)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ours = {k: ALL_ATTENTION_FUNCTIONS[k] for k in list(ALL_ATTENTION_FUNCTIONS.keys()) if k.startswith("headlab")}
        import kvpress

        # importing kvpress wraps every registered attention function (for head-wise masking, which its uniform
        # presses do not use); its wrapper reads key.shape, which headlab's per-head cache does not hand over
        for k, f in ours.items():
            ALL_ATTENTION_FUNCTIONS[k] = f

        self.kvpress, self.lm = kvpress, lm
        # kvpress 0.5.5 pins transformers < 5.3: its hooks read `past_key_values` and `cache_position`
        # from the attention call, which transformers 5.x passes as `cache` (and no position). Map them.
        def shim(module, args, kwargs):
            c = kwargs.get("cache")
            if c is not None and "past_key_values" not in kwargs:
                past = c.get_seq_length(module.layer_idx)
                n = kwargs["hidden_states"].shape[1]
                kwargs.update(past_key_values=c, cache_position=torch.arange(past, past + n))
            return args, kwargs

        for am in lm.adapter.attn_modules:
            am.register_forward_pre_hook(shim, with_kwargs=True)

    def __call__(self, name: str, ratio: float, p):
        from transformers import DynamicCache

        press = getattr(self.kvpress, name)(compression_ratio=ratio)
        hf, ids, tail = self.lm.adapter.model, p.ids, p.question
        ctx, cur = ids[:, :-tail], ids[:, -tail:]
        cache, out, pos = DynamicCache(), [], ctx.shape[1]
        with torch.no_grad():
            with press(hf):
                hf(input_ids=ctx, past_key_values=cache, use_cache=True)
            held = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers) * 4
            t0 = time.perf_counter()
            for _ in range(8):
                o = hf(input_ids=cur, past_key_values=cache, use_cache=True,
                       position_ids=torch.arange(pos, pos + cur.shape[1])[None])
                pos += cur.shape[1]
                cur = o.logits[:, -1].argmax(-1, keepdim=True)
                out.append(int(cur))
        full = 2 * 4 * len(cache.layers) * cache.layers[0].keys.shape[1] * ids.shape[1] * cache.layers[0].keys.shape[-1]
        return self.lm.tokenizer.decode(out), held / full, (time.perf_counter() - t0) / 8


def policies(lm, gates, scores, keep: float) -> list[tuple[str, object]]:
    """``[(name, policy or ("kvpress", press, ratio))]`` in table order."""
    q4, w4 = kv.full(bits=4), kv.window(4, 256, bits=4)
    out = [("full", kv.Policy.uniform("full")),
           ("full 8-bit", kv.Policy.uniform(kv.full(bits=8))),
           ("full 4-bit", kv.Policy.uniform(q4)),
           ("full 2-bit", kv.Policy.uniform(kv.full(bits=2))),
           ("streaming 4+256", kv.Policy.uniform(REST)),
           ("streaming 4+256 4-bit", kv.Policy.uniform(w4))]
    if gates is not None:
        out += [(f"trained split {keep:.0%}", kv.Policy.from_gates(lm, gates, keep=keep, rest=REST)),
                (f"trained split {keep:.0%} on 4-bit", kv.Policy.from_gates(lm, gates, keep=keep, rest=w4, kept=q4)),
                ("trained split 25% on 4-bit", kv.Policy.from_gates(lm, gates, keep=0.25, rest=w4, kept=q4))]
    if scores is not None:
        atlas = {k: torch.tensor(v) for k, v in scores["atlas_scores"].items()}
        out += [(f"atlas split {keep:.0%}", kv.Policy.from_atlas(lm, atlas, keep=keep, rest=REST)),
                (f"atlas split {keep:.0%} on 4-bit", kv.Policy.from_atlas(lm, atlas, keep=keep, rest=w4, kept=q4))]
        if "window_loss" in scores:
            out.append((f"passkey-calibrated {keep:.0%}",
                        kv.Policy.from_scores(lm, torch.tensor(scores["window_loss"]), keep=keep, rest=REST)))
        if "retrieval" in atlas:
            out.append((f"retrieval {keep:.0%}", kv.Policy.from_scores(lm, atlas["retrieval"], keep=keep, rest=REST)))
        out.append((f"importance {keep:.0%}", kv.Policy.from_importance(lm, torch.tensor(scores["importance"]),
                                                                        keep=keep, rest=REST)))
    out += [(f"random {keep:.0%}", kv.Policy.random(lm, keep=keep, rest=REST, seed=0)),
            ("snapkv 512 (headlab)", kv.Policy.snapkv(512)),
            ("kvpress StreamingLLM 50%", ("kvpress", "StreamingLLMPress", 0.5)),
            ("kvpress SnapKV 50%", ("kvpress", "SnapKVPress", 0.5))]
    return out


def share16(lm, pol, tokens: int) -> float | None:
    if not isinstance(pol, kv.Policy):
        return None
    kvh = lm.adapter.layer_kv_heads
    return (headlab.costs.policy_cache_bytes(pol, kv_heads=kvh, tokens=tokens, head_dim=64, dtype="float16")
            / headlab.costs.full_cache_bytes(layers=len(kvh), kv_heads=kvh[0], tokens=tokens, head_dim=64,
                                             dtype="float16"))


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    groups = (("full", "black"), ("streaming", "tab:orange"), ("trained", "tab:green"), ("atlas", "tab:blue"),
              ("kvpress", "tab:purple"), ("snapkv", "tab:red"))
    for r in rows:
        colour = next((c for g, c in groups if r["policy"].startswith(g)), "tab:grey")
        lo, hi = r["interval"]
        ax.errorbar(r["share16"], r["accuracy"], yerr=[[r["accuracy"] - lo], [hi - r["accuracy"]]], fmt="o",
                    color=colour, ms=4, capsize=2, lw=0.8)
        ax.annotate(r["policy"], (r["share16"], r["accuracy"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.axvline(0.5, color="grey", lw=0.5, ls="--")
    ax.axvline(0.25, color="grey", lw=0.5, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("KV bytes held, share of a 16-bit full cache (mean over the prompts)")
    ax.set_ylabel("passkey accuracy (95% Wilson interval)")
    counts = sorted({r["n"] for r in rows})
    ax.set_title(f"SmolLM2-135M: KV memory vs passkey retrieval ({' or '.join(map(str, counts))} prompts per policy)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def finish(rows, lm, gates, scores, args, specs) -> list[dict]:
    """Merge ``rows`` into results/kv_study.json (they replace rows of the same policy), compare each with the
    full cache on the prompts both read, plot, write; returns every row in table order."""
    path = RESULTS / f"{args.out}.json"
    names = {r["policy"] for r in rows}
    saved = json.loads(path.read_text()) if path.is_file() else {}
    earlier = saved.get("policies", [])
    if args.table and saved:  # only the table: the file keeps the settings and prompts of its runs
        args, specs = argparse.Namespace(**{**vars(args), **saved["args"]}), saved["specs"]
    rows = [r for r in earlier if r["policy"] not in names] + list(rows)
    full = next((r for r in rows if r["policy"] == "full"), None)
    for r in rows:
        if full is not None and len(r["oks"]) <= len(full["oks"]):  # paired on the prompts both read
            r["diff_vs_full"] = paired_diff(r["oks"], full["oks"][:len(r["oks"])])
            r["discordance_vs_full"] = discordance(r["oks"], full["oks"][:len(r["oks"])])
        if full is not None and full["perplexity"] and r["perplexity"]:
            r["ppl_change"] = r["perplexity"] / full["perplexity"] - 1
    order = [n for n, _ in policies(lm, gates, scores, args.keep)]
    rows.sort(key=lambda r: order.index(r["policy"]) if r["policy"] in order else len(order))
    plot(rows, RESULTS / f"{args.out}_pareto.png")
    write_json(args.out, {"args": {k: v for k, v in vars(args).items() if k != "table"}, "specs": specs, "policies": rows,
                            "gates": gates.settings if gates else None})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=80, help="passkey prompts per policy (paired across policies)")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--mix", default="4,3,1", help="how often each length comes in the cycle")
    ap.add_argument("--keep", type=float, default=0.5, help="share of kv heads full in the splits")
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--only", default="", help="these policies (comma-separated names, or prefixes ending in '*'); "
                    "their rows replace the same rows in results/kv_study.json")
    ap.add_argument("--kvpress", default="", help="a folder holding kvpress (see the docstring); empty: no peer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", choices=("both", "single", "multi"), default="both",
                    help="passkey kinds: alternating single- and multi-key, or one kind only")
    ap.add_argument("--out", default="kv_study", help="results/OUT.json and OUT_pareto.png (rows merge into it)")
    ap.add_argument("--table", action="store_true", help="only print the table and plot of results/kv_study.json")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    mix = [int(x) for x in args.mix.split(",")]
    if not DATA.is_dir():
        sys.exit(f"UD English-EWT not found at {DATA} (the benchmark reads it by path)")
    lm = headlab.load("smollm2")
    tok = lm.tokenizer
    gates = (kv.GateTraining.load(RESULTS / "kv_gates.json")
             if (RESULTS / "kv_gates.json").is_file() else None)
    scores = json.loads((RESULTS / "kv_scores.json").read_text()) if (RESULTS / "kv_scores.json").is_file() else None
    peer = KVPress(lm, args.kvpress) if args.kvpress else None
    dev = tok(" ".join(documents(DATA / "en_ewt-ud-dev.conllu")), return_tensors="pt")["input_ids"][:, :args.ppl_tokens]
    specs = trials(args.prompts, lengths, mix, args.seed, args.kinds)
    prompts = [passkey.prompt(tok, s["tokens"], s["depths"], s["keys"], labels=s["labels"], ask=s["ask"])
               for s in specs]
    todo = policies(lm, gates, scores, args.keep)
    if args.only:  # in the order given: a name, or a prefix ending in '*'
        todo = [(n, p) for o in args.only.split(",") for n, p in todo
                if n == o or (o.endswith("*") and n.startswith(o[:-1]))]
    if peer is None:
        todo = [(n, p) for n, p in todo if isinstance(p, kv.Policy)]
    rows = []
    if args.table:
        todo = []
    for name, pol in todo:
        t0 = time.perf_counter()
        oks, measured, shares, per_token, answers = [], [], [], [], []
        for i, (spec, pr) in enumerate(zip(specs, prompts)):
            if isinstance(pol, kv.Policy):
                snap = any(r.kind in ("snap", "adakv") for r in [pol.default, *pol.rules.values()])
                text, ratio, spt = run_headlab(lm, pol, pr, question=snap)
                shares.append(share16(lm, pol, pr.ids.shape[1]))
            else:
                text, ratio, spt = peer(pol[1], pol[2], pr)
                shares.append(ratio)
            oks.append(passkey.answered(text, spec["keys"][spec["ask"]]))
            answers.append(text)
            measured.append(ratio)
            per_token.append(spt)
            if (i + 1) % 10 == 0:
                print(f"  {name}: {i + 1}/{len(specs)} prompts, {sum(oks)} right, {time.perf_counter() - t0:.0f} s",
                      flush=True)
        ppl = (perplexity(lm, dev, policy=pol, prefill=args.ppl_tokens // 2) if isinstance(pol, kv.Policy) else None)
        k, n = sum(oks), len(oks)
        rows.append({"policy": name, "n": n, "right": k, "accuracy": k / n, "interval": wilson(k, n),
                     "single": share(oks, specs, single=True), "multi": share(oks, specs, single=False),
                     "perplexity": ppl, "share16": sum(shares) / n, "measured_share_cache_dtype": sum(measured) / n,
                     "seconds_per_token": sorted(per_token)[n // 2], "oks": oks, "answers": answers, "seconds": time.perf_counter() - t0,
                     "heads": pol.counts(lm.adapter.layer_kv_heads) if isinstance(pol, kv.Policy) else None})
        r = rows[-1]
        print(f"{name:<30} passkey {k}/{n} = {k / n:.3f} [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]  "
              f"ppl {ppl if ppl is None else round(ppl, 3)}  KV {r['share16']:.1%} of 16-bit full  "
              f"[{r['seconds']:.0f} s]", flush=True)
        finish(rows, lm, gates, scores, args, specs)  # every finished policy is kept, whatever comes after
    rows = finish(rows, lm, gates, scores, args, specs)
    def fmt(x):
        return f"{'-':>6}" if x is None else f"{x:6.2f}"

    print(f"\n{'policy':<30} {'KV/16-bit':>9} {'passkey':>8} {'95% interval':>15} {'vs full (95%)':>22} "
          f"{'lost/won':>8} {'|diff|<=':>8} {'single':>6} {'multi':>6} {'ppl':>8} {'ppl+':>6}")
    for r in rows:
        d = r.get("diff_vs_full")
        ds = f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]" if d else "-"
        pp = f"{r['perplexity']:8.3f}" if r["perplexity"] else f"{'-':>8}"
        pc = f"{r['ppl_change']:+6.1%}" if r.get("ppl_change") is not None else f"{'-':>6}"
        dc = r.get("discordance_vs_full")
        lw, bound = (f"{dc[0]}/{dc[1]}", f"{dc[2]:.3f}") if dc else ("-", "-")
        print(f"{r['policy']:<30} {r['share16']:9.1%} {r['accuracy']:8.3f} [{r['interval'][0]:.3f}, "
              f"{r['interval'][1]:.3f}] {ds:>22} {lw:>8} {bound:>8} {fmt(r['single'])} {fmt(r['multi'])} {pp} {pc}")
    for who, what in PAPER:
        print(f"published, {who}: {what}")
    print(f"wrote {RESULTS / (args.out + '.json')} and {RESULTS / (args.out + '_pareto.png')}")


if __name__ == "__main__":
    main()
