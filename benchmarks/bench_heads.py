"""Which heads matter, on real models: importance, ablation verdicts, pruning curve, physical savings.

Parts (``--part``):

- ``encoder``: the SST-2 classifier (``~/.cache/headlab/minilm-sst2``, trained by
  ``benchmarks/models/minilm_sst2.py``) on the 872 validation sentences with the task loss; when that
  folder is absent, all-MiniLM-L6-v2 with the label-free cosine loss on the same sentences.
  Importance (one backward per batch) against L x H single zero-ablation passes on the same
  examples (time and Spearman), the pair study and verdicts, the pruning curve, and forward
  throughput of the physically pruned model at 25/50/75% removed, batch 1/16/64, sequence 128.
- ``decoder``: SmolLM2-135M-Instruct (``headlab.load("smollm2")``): importance by next-token NLL on
  UD English-EWT sentences (train split), the pruning curve by perplexity on test sentences,
  GQA-aware physical removal, KV-cache bytes per token and throughput.
- ``decoder-ablation``: SmolLM2's importance against its 30 x 9 single zero-ablation passes on the
  same sentences (time and Spearman; ``heads_decoder_ablation.json``).
- ``ablate-speed``: ``headlab heads ablate --limit 128`` on the SST-2 classifier (the command's
  defaults: zero ablation, single + keep-one + 120 pairs, 1,000 resamples), timed beside the same
  study with prefix sharing and length buckets switched off (the peer, in the same run); the goal is
  2 minutes on 2 cores (``heads_ablate_speed.json``).

Michel et al. 2019 (Are Sixteen Heads Really Better than One?, section 4.2 / Table 4): pruning 50%
of BERT-base's heads gives +17.5% examples per second at batch 16-64 (about +2% at batch 1-4); about
40% of heads prunable without noticeable loss on MNLI (their figure 4).

    nice -n 5 .venv/bin/python benchmarks/bench_heads.py --part encoder
    nice -n 5 .venv/bin/python benchmarks/bench_heads.py --part encoder-curve   # curve + savings, no ablation
    nice -n 5 .venv/bin/python benchmarks/bench_heads.py --part decoder
    nice -n 5 .venv/bin/python benchmarks/bench_heads.py --part decoder-ablation   # importance vs 270 ablations
    .venv/bin/python benchmarks/bench_heads.py --part ablate-speed   # nothing else running
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, write_json  # noqa: E402

import headlab  # noqa: E402
from headlab.interpret.heads.ablation import ablate  # noqa: E402
from headlab.interpret.heads.examples import read_texts  # noqa: E402
from headlab.interpret.heads.importance import correlate, importance_study  # noqa: E402
from headlab.interpret.heads.prune import order_heads, pruning_curve  # noqa: E402
from headlab.interpret.heads.savings import measure_savings  # noqa: E402
from headlab.models import cache_dir  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
if not DATA.is_dir():
    DATA = Path("/work/shared/data")
MICHEL = {"source": "Michel et al. 2019, Are Sixteen Heads Really Better than One?, NeurIPS, section 4.2 (Table 4): "
                    "BERT-base on MNLI, 50% of heads pruned, examples per second on a GTX 1080Ti (mean +- std of 6 "
                    "runs); the rows as transcribed in a public summary of the paper (no primary copy was at hand)",
          "table4": [{"batch": 1, "original": 17.0, "pruned": 17.3, "gain_pct": 1.9},
                     {"batch": 4, "original": 67.3, "pruned": 69.1, "gain_pct": 2.7},
                     {"batch": 16, "original": 114.0, "pruned": 134.0, "gain_pct": 17.5},
                     {"batch": 64, "original": 124.7, "pruned": 146.6, "gain_pct": 17.5}],
          "throughput_gain_50pct_batch16_64": 17.5, "throughput_gain_50pct_batch1_4": 2.0,
          "prunable_share_bert_mnli": 0.4, "prunable_share_bert_sst2": 0.6}


def encoder(args) -> dict:
    torch.set_num_threads(args.threads)
    clf = cache_dir("minilm-sst2")
    texts, labels = read_texts(DATA / "sst2" / "validation.tsv", limit=args.n_encoder)
    if (clf / "config.json").is_file():
        loaded, loss = headlab.load(clf), "task"
    else:
        loaded, loss, labels = headlab.load("minilm"), "cosine", None
    n_abl = args.n_ablate
    sub_t, sub_l = texts[:n_abl], (labels[:n_abl] if labels else None)
    print(f"{loaded.name}: loss={loss}, {len(texts)} sentences (ablation on the first {n_abl})", flush=True)
    imp_small = importance_study(loaded, sub_t, sub_l, loss=loss, batch_size=16, confidence=False)
    partial = {"model": loaded.name, "loss": loss, "importance_small": imp_small.to_json()}
    abl = ablate(loaded, sub_t, sub_l, kind="zero", loss=loss, k=args.k, keep_one=True, batch_size=16, max_rows=256,
                 n_boot=1000, progress=True)
    # L x H single passes alone (same examples), for the speed comparison
    partial["ablation"] = abl.to_json()
    write_json(f"heads_encoder{args.tag}_partial", partial)
    t0 = time.perf_counter()
    ablate(loaded, sub_t, sub_l, kind="zero", loss=loss, keep_one=False, pairs=[], batch_size=16, max_rows=256,
           n_boot=10, cka=False)
    t_single = time.perf_counter() - t0
    full = importance_study(loaded, texts, labels, loss=loss, batch_size=32, single_effects=None, progress=True)
    corr = correlate(importance=imp_small.importance, ablation=abl.single, confidence=full.confidence)
    curve = pruning_curve(loaded, texts, labels, loss=loss, importance=full.normalized, batch_size=32, progress=True)
    png = curve.plot(RESULTS / "heads_encoder_curve.png")
    order = order_heads(full.normalized)
    partial.update(curve=curve.to_json(), single_ablation_seconds=t_single)
    write_json(f"heads_encoder{args.tag}_partial", partial)
    sav = measure_savings(loaded, order, batch_sizes=tuple(args.batches), seq=128, repeats=args.repeats,
                          rounds=args.rounds, progress=True)
    return {"model": loaded.name, "loss": loss, "n_examples": len(texts), "n_ablation_examples": n_abl,
            "importance": full.to_json(), "ablation": abl.to_json(), "verdict_counts": abl.counts(),
            "importance_vs_ablation": {"importance_seconds": imp_small.seconds, "single_ablation_seconds": t_single,
                                       "speedup_x": t_single / imp_small.seconds, "n_heads": int((~abl.single.isnan()).sum()),
                                       "spearman": corr},
            "curve": curve.to_json(), "curve_png": str(png.relative_to(RESULTS.parent)), "savings": sav.to_json(),
            "paper": MICHEL}


def encoder_curve(args) -> dict:
    """The SST-2 classifier's pruning curve and physical savings, ranked by importance on every
    validation sentence; the ablation study (``--part encoder``) is not repeated: its verdicts are
    read from ``heads_encoder_partial.json`` when that file holds the classifier's run."""
    import json

    torch.set_num_threads(args.threads)
    clf = cache_dir("minilm-sst2")
    if not (clf / "config.json").is_file():
        raise SystemExit(f"no classifier at {clf}: train it with benchmarks/models/minilm_sst2.py first")
    texts, labels = read_texts(DATA / "sst2" / "validation.tsv", limit=args.n_encoder)
    loaded = headlab.load(clf)
    print(f"{loaded.name}: task loss, {len(texts)} sentences", flush=True)
    full = importance_study(loaded, texts, labels, loss="task", batch_size=32, progress=True)
    curve = pruning_curve(loaded, texts, labels, loss="task", importance=full.normalized, batch_size=32, progress=True)
    png = curve.plot(RESULTS / "heads_encoder_sst2_curve.png")
    order = order_heads(full.normalized)
    sav = measure_savings(loaded, order, batch_sizes=tuple(args.batches), seq=128, repeats=args.repeats,
                          rounds=args.rounds, progress=True)
    out = {"model": loaded.name, "loss": "task", "n_examples": len(texts), "importance": full.to_json(),
           "curve": curve.to_json(), "curve_png": str(png.relative_to(RESULTS.parent)), "savings": sav.to_json(),
           "savings_threads": args.threads, "paper": MICHEL}
    part = RESULTS / "heads_encoder_partial.json"
    if part.is_file():
        prev = json.loads(part.read_text())
        if prev.get("model") == loaded.name and "ablation" in prev:
            out["ablation_from"] = str(part.relative_to(RESULTS.parent))
            out["verdict_counts"] = prev["ablation"].get("counts")
    return out


def decoder(args) -> dict:
    loaded = headlab.load("smollm2")
    train, _ = read_texts(DATA / "ud-english-ewt" / "en_ewt-ud-train.conllu")
    test, _ = read_texts(DATA / "ud-english-ewt" / "en_ewt-ud-test.conllu")
    train = [t for t in train if len(t.split()) >= 5][: args.n_decoder]
    test = [t for t in test if len(t.split()) >= 5][: args.n_decoder_test]
    torch.set_num_threads(args.threads)
    print(f"smollm2: importance on {len(train)} train sentences, curve on {len(test)} test sentences", flush=True)
    imp = importance_study(loaded, train, loss="lm", batch_size=8, confidence=True, progress=True)
    curve = pruning_curve(loaded, test, loss="lm", importance=imp.normalized, batch_size=16, progress=True)
    png = curve.plot(RESULTS / "heads_decoder_curve.png")
    order = order_heads(imp.normalized)
    write_json("heads_decoder_partial", {"importance": imp.to_json(), "curve": curve.to_json()})
    sav = measure_savings(loaded, order, batch_sizes=tuple(args.decoder_batches), seq=128, repeats=args.repeats,
                          rounds=args.rounds, progress=True)
    return {"model": "smollm2", "n_importance": len(train), "n_test": len(test), "importance": imp.to_json(),
            "curve": curve.to_json(), "curve_png": str(png.relative_to(RESULTS.parent)), "savings": sav.to_json()}


def decoder_ablation(args) -> dict:
    """SmolLM2: Michel et al.'s importance for every head (one forward and backward per batch) against the
    L x H single zero-ablation passes on the same UD English-EWT sentences: time, and the Spearman
    correlation of the two rankings (and of each with Voita's confidence)."""
    loaded = headlab.load("smollm2")
    train, _ = read_texts(DATA / "ud-english-ewt" / "en_ewt-ud-train.conllu")
    texts = [t for t in train if len(t.split()) >= 5][: args.n_ablate_decoder]
    torch.set_num_threads(args.threads)
    L, H = loaded.adapter.n_layers, loaded.adapter.n_heads
    print(f"smollm2: importance vs {L * H} single ablations on {len(texts)} train sentences", flush=True)
    imp = importance_study(loaded, texts, loss="lm", batch_size=8, confidence=True, progress=True)
    t0 = time.perf_counter()
    abl = ablate(loaded, texts, kind="zero", loss="lm", keep_one=False, pairs=[], batch_size=8, max_rows=64,
                 n_boot=200, cka=False, progress=True)
    t_single = time.perf_counter() - t0
    corr = correlate(importance=imp.importance, ablation=abl.single, confidence=imp.confidence)
    return {"model": "smollm2", "n_examples": len(texts), "threads": args.threads,
            "importance_vs_ablation": {"importance_seconds": imp.seconds, "single_ablation_seconds": t_single,
                                       "speedup_x": t_single / imp.seconds,
                                       "n_heads": int((~abl.single.isnan()).sum()), "spearman": corr},
            "importance": imp.to_json(), "single_effects": abl.to_json()}


def encoder_savings(args, part: str = "encoder") -> dict:
    """Re-measure only the savings of a part, ranking by the importance saved in its JSON."""
    import json

    torch.set_num_threads(args.threads)
    path = RESULTS / f"heads_{part}.json"
    res = json.loads(path.read_text())
    if part == "decoder":
        loaded = headlab.load("smollm2")
        args.batches = args.decoder_batches
    else:
        loaded = headlab.load(res["model"]) if res["model"] == "minilm" else headlab.load(cache_dir("minilm-sst2"))
    order = order_heads(torch.tensor([[float("nan") if x is None else x for x in r]
                                      for r in res["importance"]["normalized"]]))
    sav = measure_savings(loaded, order, batch_sizes=tuple(args.batches), seq=128, repeats=args.repeats,
                          rounds=args.rounds, progress=True)
    res["savings"] = sav.to_json()
    res["savings_threads"] = args.threads
    return res


def ablate_speed(args) -> dict:
    """The CLI's ablation on 128 sentences, and the same without prefix sharing and length buckets."""
    import headlab.interpret.heads.examples as C
    import headlab.interpret.heads.edits as E

    torch.set_num_threads(args.threads)
    clf = cache_dir("minilm-sst2")
    if not (clf / "config.json").is_file():
        raise SystemExit(f"no classifier at {clf}: headlab train-classifier --data {DATA / 'sst2'}")
    loaded = headlab.load(clf)
    texts, labels = read_texts(DATA / "sst2" / "validation.tsv", limit=128)
    t0 = time.perf_counter()
    fast = ablate(loaded, texts, labels, progress=True)  # the defaults of `headlab heads ablate`
    t_fast = time.perf_counter() - t0
    blocks, batches = E.blocks, C.batches
    E.blocks = lambda adapter: None  # the peer: every configuration runs every layer on repeated inputs ...
    C.batches = lambda *a, by_length=False, **k: batches(*a, **k)  # ... in consecutive batches
    try:
        t0 = time.perf_counter()
        peer = ablate(loaded, texts, labels, progress=True)
        t_peer = time.perf_counter() - t0
    finally:
        E.blocks, C.batches = blocks, batches
    diff = float((fast.single - peer.single).abs().nan_to_num().max())
    same = [v.label() for v in fast.verdicts] == [v.label() for v in peer.verdicts]
    print(f"heads ablate --limit 128: {t_fast:.1f} s (goal 120 s); without prefix sharing and length buckets "
          f"{t_peer:.1f} s: x{t_peer / t_fast:.2f}; max |single effect difference| {diff:.2e}, verdicts equal: {same}")
    return {"model": loaded.name, "n_examples": len(texts), "seconds": t_fast, "peer_seconds": t_peer,
            "speedup_x": t_peer / t_fast, "goal_seconds": 120, "max_single_effect_difference": diff,
            "verdicts_equal": same, "verdict_counts": fast.counts(), "threads": args.threads,
            "phases": fast.seconds, "peer_phases": peer.seconds}


def _table(res: dict) -> None:
    if "importance_vs_ablation" in res:
        iv = res["importance_vs_ablation"]
        print(f"importance {iv['importance_seconds']:.1f} s vs {iv['n_heads']} single ablations "
              f"{iv['single_ablation_seconds']:.1f} s: x{iv['speedup_x']:.1f} faster; Spearman {iv['spearman']}")
        if "verdict_counts" in res:
            print("verdicts:", res["verdict_counts"])
    if "curve" not in res:
        return
    print(res["curve"]["summary"])
    print(f"{'removed':>8} {'batch':>6} {'unpruned ex/s':>14} {'pruned ex/s':>12} {'gain':>7} {'params':>11} {'kv B/tok':>9}")
    for r in res["savings"]["rows"]:
        print(f"{100 * r['fraction_removed']:7.0f}% {r['batch']:6d} {r['unpruned_examples_per_s']:14.1f} "
              f"{r['pruned_examples_per_s']:12.1f} {r['throughput_gain_pct']:+6.1f}% {r['params']:11,d} "
              f"{r['kv_cache_bytes_per_token'] or '-':>9} {r.get('cpu_time_gain_pct', float('nan')):+8.1f}% cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["encoder", "encoder-curve", "decoder", "decoder-ablation", "encoder-savings",
                                       "decoder-savings", "ablate-speed"],
                    required=True)
    ap.add_argument("--n-encoder", type=int, default=None, help="SST-2 sentences (default: all 872)")
    ap.add_argument("--n-ablate", type=int, default=256)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-decoder", type=int, default=64)
    ap.add_argument("--n-decoder-test", type=int, default=64)
    ap.add_argument("--n-ablate-decoder", type=int, default=32, help="sentences of the decoder-ablation part")
    ap.add_argument("--decoder-batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tag", default="")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    res = {"encoder": encoder, "encoder-curve": encoder_curve, "decoder": decoder, "encoder-savings": encoder_savings,
           "decoder-savings": lambda a: encoder_savings(a, "decoder"), "decoder-ablation": decoder_ablation,
           "ablate-speed": ablate_speed}[args.part](args)
    _table(res)
    name = {"encoder-curve": "heads_encoder_sst2", "decoder-ablation": "heads_decoder_ablation",
            "ablate-speed": "heads_ablate_speed"}.get(
        args.part, f"heads_{args.part.split('-')[0]}")
    path = write_json(f"{name}{args.tag}", res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
