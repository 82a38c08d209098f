"""Indirect-object identification (Wang et al. 2022) on SmolLM2-135M: patching, attribution, path patching.

Prompts come from ``headlab.interpret.circuits.tasks.ioi_prompts`` (the library's IOI task), built from Wang
et al.'s templates (their BABA templates and the ABBA twins that swap the first two names), with single-token
names, places and objects. The clean prompt ends where the indirect object (IO) should come: "Then, Mary
and John went to the store. John gave a drink to" -> " Mary" (the subject S is John). The corrupted twin is
their "ABC" distribution: the same template with three other, all different names, so no name repeats and
the prompt says nothing about which one is the answer. The metric is the logit difference IO - S at the last token.

Measured:

- the clean and corrupted logit difference (mean over prompts) and the share of prompts where IO wins;
- exact patching of every head's output z (corrupted into clean, all positions): the heads that move
  the logit difference most (effect = (m_patched - m_clean) / (m_corrupted - m_clean));
- attribution patching of every head (one forward + one backward): Spearman and Pearson against
  exact patching, the overlap of their top 10, and the time ratio;
- the logit lens of IO - S after every block;
- path patching of the top heads into the logits (each head's direct path, every other head frozen),
  direct logit attribution, and each top head's attention from the last token to IO, S1 and S2;
- the atlas's induction, duplicate-token and previous-token scores (pattern scores, checks off) of the
  top heads, where ``headlab.atlas`` exists.

Wang et al.'s figures for GPT-2 small (12 x 12 = 144 heads) sit beside the numbers; SmolLM2 has 30 x 9 =
270 query heads on 3 kv heads per layer.

    nice -n 5 .venv/bin/python benchmarks/bench_ioi.py            # 16 prompts (about 15 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_ioi.py --n 4 --no-save     # a quick look
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

# the templates, names, places and objects, and the pair-building, live in the library; bench_tp_smollm2 imports
# prompts from here
from headlab.interpret.circuits.tasks import ioi_prompts as prompts  # noqa: E402

# Wang et al. 2022 (arXiv 2211.00593), GPT-2 small; head "L.H"
PAPER = {
    "model": "GPT-2 small (12 layers x 12 heads = 144)",
    "logit_diff_clean": 3.56,
    "circuit": "26 heads in 7 classes (arXiv v1; the ICLR 2023 version counts 28)",
    "name_movers": ["9.6", "9.9", "10.0"],
    "negative_name_movers": ["10.7", "11.10"],
    "s_inhibition": ["7.3", "7.9", "8.6", "8.10"],
    "induction": ["5.5", "6.9"],
    "duplicate_token": ["0.1", "0.10", "3.0"],
    "previous_token": ["2.2", "4.11"],
    "backup_name_movers": ["9.0", "9.7", "10.1", "10.2", "10.6", "10.10", "11.2", "11.9"],
}


def positions_of(ids: torch.Tensor, token: int) -> list[int]:
    return [i for i, t in enumerate(ids.tolist()) if t == token]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16, help="prompts")
    ap.add_argument("--top", type=int, default=20, help="heads path-patched and listed")
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--no-atlas", action="store_true")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    import headlab
    from headlab.interpret.patching import attribution_patch, compare, patch, path_patch
    from headlab.interpret.patching.prompts import prompt_pair
    from headlab.interpret.patching.readout import direct_logit_attribution, logit_lens

    t0 = time.perf_counter()
    lm = headlab.load("smollm2")
    tok = lm.tokenizer
    quads = prompts(tok, args.n)
    clean, corrupt, io, s = (list(x) for x in zip(*quads))
    a, b, metric = prompt_pair(lm, clean, corrupt, [" " + w for w in io], [" " + w for w in s])
    io_ids = [tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in io]
    s_ids = [tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in s]
    last = a["attention_mask"].sum(-1) - 1
    A = lm.adapter
    print(f"SmolLM2-135M-Instruct, {args.n} IOI prompts (ABBA/BABA), {torch.get_num_threads()} threads; "
          f"e.g. {clean[0]!r} -> {' ' + io[0]!r}, corrupted {corrupt[0]!r}", flush=True)

    t = time.perf_counter()
    exact = patch(lm, a, b, metric, sites="z", max_rows=args.max_rows, progress=True)
    t_exact = time.perf_counter() - t
    t = time.perf_counter()
    attr = attribution_patch(lm, a, b, metric, sites="z")
    t_attr = time.perf_counter() - t
    agree = compare(exact, attr, "z", k=10)
    agree["time_ratio"] = t_exact / t_attr
    print(f"clean logit diff {exact.clean:.3f}, corrupted {exact.corrupted:.3f}; exact patching {t_exact:.1f} s, "
          f"attribution {t_attr:.2f} s ({agree['time_ratio']:.0f}x); Spearman {agree['spearman']:.3f}, "
          f"Pearson {agree['pearson']:.3f}, top-10 overlap {agree['top10_overlap']}/10", flush=True)

    with torch.no_grad():
        ld_clean = metric(A.forward(a).logits)
    top = exact.top(args.top, "z")
    t = time.perf_counter()
    direct = path_patch(lm, a, b, metric, senders=[(l, h) for l, h, _ in top], max_rows=args.max_rows)
    t_path = time.perf_counter() - t
    dla = direct_logit_attribution(lm, a, io_ids, s_ids, position=last)
    lens = logit_lens(lm, a, position=last).logit_diff(io_ids, s_ids).mean(-1)  # (layers + 1,) IO - S by depth
    cache = headlab.capture(lm, a, [A.site_name(l, "pattern") for l in sorted({l for l, _, _ in top})])
    attn = {}
    for l, h, _ in top:
        pat = cache[A.site_name(l, "pattern")]  # (B, H, L, L)
        row = {"io": [], "s1": [], "s2": []}
        for i in range(args.n):
            ids = a["input_ids"][i]
            p_io, p_s = positions_of(ids, io_ids[i]), positions_of(ids, s_ids[i])
            q = int(last[i])
            row["io"].append(float(pat[i, h, q, p_io[0]]))
            row["s1"].append(float(pat[i, h, q, p_s[0]]))
            row["s2"].append(float(pat[i, h, q, p_s[1]]) if len(p_s) > 1 else float("nan"))
        attn[(l, h)] = {k: sum(v) / len(v) for k, v in row.items()}

    atlas_scores, atlas_note, at, atlas_top = {}, None, None, {}
    kinds = ("previous_token", "duplicate_token", "induction")
    if not args.no_atlas:
        try:
            t = time.perf_counter()
            at = headlab.atlas(lm, kinds=list(kinds), checks=False)
            atlas_scores = {k: at.scores[k] for k in kinds}
            atlas_note = (f"atlas pattern scores (causal checks off), {time.perf_counter() - t:.1f} s; role thresholds "
                          + ", ".join(f"{k} {at.thresholds[k]}" for k in kinds))
        except Exception as e:  # noqa: BLE001  (the atlas is another helper's work; report, do not fail)
            atlas_note = f"atlas not used: {type(e).__name__}: {e}"
    if at is not None:  # where the atlas's strongest heads of each kind rank by exact patching (1 = moves it most)
        order = torch.argsort(torch.nan_to_num(exact.effects["z"].abs(), nan=-1).flatten(), descending=True)
        rank = {int(i): r + 1 for r, i in enumerate(order)}
        atlas_top = {k: [{"head": f"{l}.{h}", "score": round(float(at.scores[k][l, h]), 3),
                          "exact": round(float(exact.effects["z"][l, h]), 4), "rank": rank[l * A.n_heads + h]}
                         for l, h in at.top(k, 5)] for k in kinds}

    rows = []
    for l, h, eff in top:
        row = {"head": f"{l}.{h}", "kv_head": h // (A.n_heads // A.n_kv_heads), "exact": round(eff, 4),
               "attribution": round(float(attr.effects["z"][l, h]), 4),
               "direct_path": round(float(direct.effects["z"][l, h]), 4),
               "dla": round(float(dla.heads[l, h]), 4),
               **{f"attn_{k}": round(v, 3) for k, v in attn[(l, h)].items()},
               **{k: round(float(v[l, h]), 3) for k, v in atlas_scores.items()}}
        if at is not None:
            row["roles"] = ",".join(at.roles(l, h)) or "-"
        rows.append(row)
    cols = list(rows[0])
    print(f"\nTop {len(rows)} heads by |exact effect| (effect: 1 = the whole clean-to-corrupted gap; direct_path: "
          "the head's path into the logits alone; dla: logits units; attn_*: from the last token)")
    print(" ".join(f"{c[:9]:>9}" for c in cols))
    for row in rows:
        print(" ".join(f"{row[c]:>9}" for c in cols))
    frac_right = float((ld_clean > 0).float().mean())
    total = time.perf_counter() - t0
    dla_top = dla.top(6)
    print(f"\nIO beats S in {frac_right:.0%} of clean prompts; DLA top: "
          + ", ".join(f"{l}.{h} {v:+.2f}" for l, h, v in dla_top))
    half = next(i for i, v in enumerate(lens.tolist()) if v >= lens[-1] / 2)
    print("logit lens, IO - S after each block: " + " ".join(f"{v:.1f}" for v in lens.tolist()[1:])
          + f" (half of the final value first after block {half - 1})")
    print(f"Wang et al. (GPT-2 small): logit diff {PAPER['logit_diff_clean']}, {PAPER['circuit']}; name movers "
          f"{', '.join(PAPER['name_movers'])}; S-inhibition {', '.join(PAPER['s_inhibition'])}")
    if atlas_note:
        print(atlas_note)
    for k, items in atlas_top.items():
        print(f"atlas top {k}: " + ", ".join(f"{d['head']} (score {d['score']}, exact {d['exact']:+.3f}, rank "
                                             f"{d['rank']}/{A.n_layers * A.n_heads})" for d in items))
    print(f"total {total:.0f} s on {torch.get_num_threads()} threads (shared machine)")
    if args.no_save:
        return
    path = write_json("ioi_smollm2", {
        "model": "SmolLM2-135M-Instruct", "n_prompts": args.n, "prompts": quads[:4],
        "logit_diff": {"clean": exact.clean, "corrupted": exact.corrupted, "io_wins": frac_right},
        "exact_seconds": t_exact, "attribution_seconds": t_attr, "path_seconds": t_path, "total_seconds": total,
        "agreement": agree, "top_heads": rows, "dla_top": [list(x) for x in dla_top],
        "dla_rest_mean": float(dla.rest.mean()),
        "logit_lens_io_minus_s": [round(v, 4) for v in lens.tolist()], "exact": exact.to_json(), "attribution": attr.to_json(),
        "atlas": atlas_note, "atlas_top": atlas_top, "paper_gpt2_small": PAPER,
        "convention": "effect = (m_patched - m_clean) / (m_corrupted - m_clean); corrupted = ABC (three other names)"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
