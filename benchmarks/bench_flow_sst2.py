"""Abnar and Zuidema (2020)'s correlation study on the fine-tuned MiniLM SST-2 classifier.

    nice -n 5 .venv/bin/python benchmarks/bench_flow_sst2.py                    # the 872 validation sentences
    nice -n 5 .venv/bin/python benchmarks/bench_flow_sst2.py --limit 50         # quick
    nice -n 5 .venv/bin/python benchmarks/bench_flow_sst2.py --model PATH       # another classifier folder

The classifier is the one ``benchmarks/models/minilm_sst2.py`` trains (a BertForSequenceClassification
folder at ``~/.cache/headlab/minilm-sst2``); without it the script says so and stops.

For each sentence (/work/shared/data/sst2/validation.tsv) and its predicted class c:

* blank-out importance of token t: ``p(c | x) - p(c | x with token t replaced by [UNK])`` (one batch of
  n - 2 variants; [CLS] and [SEP] are not blanked and not scored);
* raw attention at layer l: the [CLS] row of the mean-of-heads attention of layer l;
* rollout, norm-based rollout: the [CLS] row of the rollout through layer l;
* attention flow: the normalised max-flow from the [CLS] node at the output of layer l to each input node;
* raw_max, rollout_max: the paper's own protocol (``max(axis=0)`` in ``samiraabnar/attention_flow``):
  for each input token, the maximum over all output positions of the raw map / the rollout through layer l
  (for the flow that protocol needs one max-flow per output token, n times the work; not run);
* gradient x input: ``sum_d (dp(c)/de_t)_d e_t,d`` at the word embeddings (one value per layer: it does
  not depend on the layer).

Per layer: Spearman correlation between each score and blank-out over the sentence's tokens, averaged
over sentences (sentences with fewer than 3 scored tokens or constant scores are skipped, and counted).
Abnar and Zuidema's figures (their SST-2 table, layer 6 of their 6-layer classifier, Spearman with
blank-out): raw attention 0.29, rollout 0.71, flow 0.70 (Abnar and Zuidema 2020, "Quantifying Attention
Flow in Transformers", ACL, https://aclanthology.org/2020.acl-main.385). Writes
benchmarks/results/flow_sst2.json.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

import headlab  # noqa: E402
from headlab.interpret.flow.maxflow import flow_values  # noqa: E402
from headlab.interpret.flow.record import record  # noqa: E402
from headlab.interpret.flow.rollout import augment, layer_matrices, rollout_maps  # noqa: E402
from headlab.models import cache_dir  # noqa: E402

DATA = Path("/work/shared/data/sst2/validation.tsv")
METHODS = ("raw", "rollout", "flow", "norm_rollout", "grad_x_input", "raw_max", "rollout_max")
PAPER_L6 = {"raw": 0.29, "rollout": 0.71, "flow": 0.70}


def load_sentences(limit: int | None) -> list[str]:
    with DATA.open() as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    out = [r["sentence"].strip() for r in rows if r["sentence"].strip()]
    return out[:limit] if limit else out


def scores(lm, text: str) -> tuple[dict, np.ndarray]:
    """{method: (L, n) scores} and the blank-out importance (n,) for one sentence."""
    model, tok = lm.model, lm.tokenizer
    enc = lm.encode(text)
    ids = enc["input_ids"]
    n = ids.shape[1]
    with torch.no_grad():
        probs = torch.softmax(model(**enc).logits, -1)[0]
    c = int(probs.argmax())
    # blank-out: replace each inner token by [UNK]
    variants = ids.repeat(n - 2, 1)
    idx = torch.arange(n - 2)
    variants[idx, idx + 1] = tok.unk_token_id
    with torch.no_grad():
        pb = torch.softmax(model(input_ids=variants, attention_mask=torch.ones_like(variants)).logits, -1)[:, c]
    blank = np.zeros(n)
    blank[1:-1] = (probs[c] - pb).numpy()
    # gradient x input at the word embeddings
    emb = model.base_model.embeddings.word_embeddings(ids).detach().requires_grad_(True)
    p = torch.softmax(model(inputs_embeds=emb, attention_mask=enc["attention_mask"]).logits, -1)[0, c]
    (g,) = torch.autograd.grad(p, emb)
    gxi = (g * emb).sum(-1)[0].detach().numpy()
    # attention-based scores, every layer
    rec = record(lm, enc, maps=True)
    with torch.no_grad():
        A = layer_matrices(rec, "mean")  # (L, n, n)
        Ah = augment(A)
        roll_all = rollout_maps(Ah)  # (L, n, n)
        roll = roll_all[:, 0]  # (L, n): the [CLS] row
        nroll = rollout_maps(augment(layer_matrices(rec, "norm")))[:, 0]
    L = A.shape[0]
    flow = np.zeros((L, n))
    for l in range(L):
        v = flow_values(Ah[: l + 1], 0, l + 1).values
        flow[l] = v / v.sum()
    out = {"raw": A[:, 0].numpy(), "rollout": roll.numpy(), "flow": flow, "norm_rollout": nroll.numpy(),
           "grad_x_input": np.tile(gxi, (L, 1)),
           # the paper's protocol (their correlation script): each input token's maximum over all output positions
           "raw_max": A.amax(1).numpy(), "rollout_max": roll_all.amax(1).numpy()}
    return out, blank


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(cache_dir("minilm-sst2")))
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"no classifier at {args.model} (config.json missing): train it with "
                         "benchmarks/models/minilm_sst2.py first; this study is not run")
    torch.set_num_threads(1)  # one thread: on a shared machine a second one mostly spins
    lm = headlab.load(args.model)
    texts = load_sentences(args.limit)
    L = lm.adapter.n_layers
    corr = {m: [[] for _ in range(L)] for m in METHODS}
    skipped = 0
    t0 = time.perf_counter()
    for i, text in enumerate(texts):
        sc, blank = scores(lm, text)
        inner = slice(1, len(blank) - 1)
        if len(blank) - 2 < 3 or np.ptp(blank[inner]) == 0:
            skipped += 1
            continue
        for m in METHODS:
            for l in range(L):
                x = sc[m][l][inner]
                if np.ptp(x) == 0:
                    continue
                corr[m][l].append(spearmanr(x, blank[inner]).statistic)
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{len(texts)} sentences, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            _save(args, corr, i + 1, len(texts), skipped, time.perf_counter() - t0)  # partial results survive
    secs = time.perf_counter() - t0
    table, spread = _save(args, corr, len(texts), len(texts), skipped, secs)
    print(f"MiniLM SST-2 classifier, {len(texts) - skipped} of {len(texts)} validation sentences ({secs:.0f} s): "
          "mean Spearman with blank-out importance, [CLS] at each layer")
    print(f"{'layer':>5} " + " ".join(f"{m:>13}" for m in METHODS))
    for l in range(L):
        print(f"{l + 1:>5} " + " ".join(f"{table[m][l]:>13.3f}" for m in METHODS))
    print("paper, layer 6: " + ", ".join(f"{k} {v}" for k, v in PAPER_L6.items()))
    print("wrote benchmarks/results/flow_sst2.json")


def _save(args, corr, done: int, total: int, skipped: int, secs: float):
    table = {m: [float(np.mean(v)) if v else None for v in corr[m]] for m in METHODS}
    spread = {m: [float(np.std(v)) if v else None for v in corr[m]] for m in METHODS}
    write_json("flow_sst2", {"model": args.model, "sentences_done": done, "sentences_total": total,
                             "skipped": skipped, "spearman_mean": table, "spearman_std": spread, "seconds": secs,
                             "paper_layer6": PAPER_L6,
                             "paper": "Abnar and Zuidema 2020, Quantifying Attention Flow in Transformers, ACL"})
    return table, spread


if __name__ == "__main__":
    main()
