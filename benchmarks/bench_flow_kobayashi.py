"""Kobayashi et al. (2020)'s finding on MiniLM: attention *weight* piles onto special tokens, attention *norm* does not.

    nice -n 5 .venv/bin/python benchmarks/bench_flow_kobayashi.py                 # 500 UD English-EWT sentences
    nice -n 5 .venv/bin/python benchmarks/bench_flow_kobayashi.py --sentences 50  # quick

Text only: the ``# text =`` lines of the UD English-EWT dev set (CoNLL-U), the first ``--sentences`` of them.
For every sentence, layer and head, and every query token i: the share of the weight row alpha_i. and of
the per-head norm row ||alpha_ij f_h(x_j)|| / sum_j ||alpha_ij f_h(x_j)|| that falls on [CLS], on [SEP],
on punctuation tokens (every character punctuation) and on the rest; averaged over queries, heads and
sentences. The residual-aware layer map (Kobayashi et al. 2021) is reported beside it as the share of the
layer map ``||sum_h alpha f + residual||`` on each category.

Writes benchmarks/results/flow_kobayashi.json and flow_kobayashi.png.
"""

from __future__ import annotations

import argparse
import string
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, write_json  # noqa: E402

import headlab  # noqa: E402
from headlab.interpret.flow.views import category_shares  # noqa: E402

DATA = Path("/work/shared/data/ud-english-ewt/en_ewt-ud-dev.conllu")
CATS = ("[CLS]", "[SEP]", "punctuation", "other")
PAPER = ("Kobayashi et al. 2020 (EMNLP, 'Attention is Not Only a Weight: Analyzing Transformers with Vector "
         "Norms', https://aclanthology.org/2020.emnlp-main.574), abstract: 'contrary to previous studies, BERT "
         "pays poor attention to special tokens'; their per-layer figure on BERT-base shows large attention "
         "weights on [CLS], [SEP] and punctuation in the middle layers and small norms ||alpha f(x)|| on them.")


def sentences(path: Path, k: int) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("# text ="):
            out.append(line.split("=", 1)[1].strip())
            if len(out) == k:
                break
    return out


def categories(tokens: list[str]) -> dict[str, list[int]]:
    n = len(tokens)
    punct = [i for i, t in enumerate(tokens[1:-1], 1) if all(c in string.punctuation for c in t)]
    other = [i for i in range(1, n - 1) if i not in punct]
    return {"[CLS]": [0], "[SEP]": [n - 1], "punctuation": punct, "other": other}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=int, default=500)
    args = ap.parse_args(argv)
    if not DATA.is_file():
        raise SystemExit(f"{DATA} not found (the UD English-EWT dev set)")
    torch.set_num_threads(1)  # one thread: on a shared machine a second one mostly spins
    lm = headlab.load("minilm")
    texts = sentences(DATA, args.sentences)
    L = lm.adapter.n_layers
    sums = {mode: torch.zeros(L, len(CATS)) for mode in ("weight", "norm", "residual")}
    t0 = time.perf_counter()
    used = 0
    for text in texts:
        res = headlab.attention_norms(lm, text, mode="attention")
        resid = headlab.attention_norms(lm, text, mode="residual")
        cats = categories(res.tokens)
        for l in range(L):
            shares = category_shares(res.weights[l], res.per_head[l], cats)
            lay = category_shares(resid.layer[l].unsqueeze(0), resid.layer[l].unsqueeze(0), cats)
            for c, name in enumerate(CATS):
                sums["weight"][l, c] += shares[name][0]
                sums["norm"][l, c] += shares[name][1]
                sums["residual"][l, c] += lay[name][1]
        used += 1
    secs = time.perf_counter() - t0
    table = {mode: (s / used).tolist() for mode, s in sums.items()}
    print(f"MiniLM, {used} UD English-EWT dev sentences ({secs:.0f} s): share of each row on each token category")
    print(f"{'layer':>5} | " + " | ".join(f"{c:>11} w / norm" for c in CATS[:3]) + " | residual-aware on [CLS] [SEP]")
    for l in range(L):
        w, nm, rs = table["weight"][l], table["norm"][l], table["residual"][l]
        print(f"{l:>5} | " + " | ".join(f"{w[c]:>9.3f} / {nm[c]:.3f}" for c in range(3)) + f" | {rs[0]:.3f} {rs[1]:.3f}")
    png = RESULTS / "flow_kobayashi.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), sharey=True)
        for ax, c in zip(axes, range(3)):
            ax.plot(range(L), [table["weight"][l][c] for l in range(L)], "o-", label="attention weight alpha")
            ax.plot(range(L), [table["norm"][l][c] for l in range(L)], "s-", label="norm ||alpha f(x)||")
            ax.plot(range(L), [table["residual"][l][c] for l in range(L)], "^:", label="residual-aware (2021)")
            ax.set_title(CATS[c])
            ax.set_xlabel("layer")
        axes[0].set_ylabel("share of the row (mean)")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"MiniLM on {used} UD English-EWT sentences: weight vs norm on special tokens")
        fig.tight_layout()
        RESULTS.mkdir(parents=True, exist_ok=True)
        fig.savefig(png, dpi=110)
    except ImportError:
        png = None
    path = write_json("flow_kobayashi", {"model": "all-MiniLM-L6-v2", "sentences": used, "data": str(DATA),
                                         "categories": list(CATS), "share": table, "seconds": secs,
                                         "paper": PAPER, "png": str(png) if png else None})
    print(f"wrote {path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
