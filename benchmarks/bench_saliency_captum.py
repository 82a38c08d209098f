"""headlab's integrated gradients and leave-one-out against captum's, on the SST-2 MiniLM classifier.

    python benchmarks/bench_saliency_captum.py [--model DIR] [--tokens 64] [--repeats 3]

Same sentence (exactly ``--tokens`` tokens with [CLS] and [SEP]), same target (the predicted class),
same baseline (special tokens kept, the others the pad token), same 50 Gauss-Legendre steps:

- IG: ``headlab.explain(..., methods=("integrated_gradients",), backend="sdpa")`` against captum's
  ``LayerIntegratedGradients`` on the word-embedding layer (``internal_batch_size`` = 50, one batch,
  as headlab's), on the model's Hugging Face SDPA path and on its eager path;
- LOO: headlab's ``loo="unk"`` (the token replaced by [UNK], one batch) against captum's
  ``FeatureAblation`` with [UNK] as the baseline, one token per feature, all in one batch. For two
  classes the TVD headlab reports equals ``|p_y(x) - p_y(x with t -> [UNK])|``, which is what
  ``FeatureAblation`` returns on the target probability (up to the sign).

Reports the largest relative difference ``max |a - b| / max |b|`` and the time ratio
("time / captum's": below 1 means headlab is faster). Needs captum (`pip install 'headlab[compare]'`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

SENTENCE = ("it 's a charming and often affecting journey , and the performances are uniformly excellent , "
            "though the script , which was written by a committee of people who seem never to have met , "
            "loses its way in the last act and the ending is far too neat for a film this messy and alive .")


def sentence_of(tokenizer, n: int) -> str:
    """A prefix of SENTENCE (repeated as needed) that tokenises to exactly ``n`` tokens with the special ones."""
    words = (SENTENCE + " ") * 4
    words = words.split()
    for k in range(1, len(words) + 1):
        text = " ".join(words[:k])
        m = len(tokenizer(text)["input_ids"])
        if m == n:
            return text
        if m > n:
            break
    raise SystemExit(f"could not build a sentence of exactly {n} tokens")


def timed(fn, repeats: int):
    out, times = None, []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main(argv=None) -> int:
    from headlab.models import cache_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(cache_dir("minilm-sst2")))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    try:
        from captum.attr import FeatureAblation, LayerIntegratedGradients
    except ModuleNotFoundError:
        raise SystemExit("this benchmark needs captum: pip install 'headlab[compare]' (or pip install captum)") from None
    if not (Path(args.model).expanduser() / "config.json").is_file():
        raise SystemExit(f"no model at {args.model}: run benchmarks/models/minilm_sst2.py first")
    torch.set_num_threads(args.threads)
    import headlab

    loaded = headlab.load(args.model)
    model, tok = loaded.model, loaded.tokenizer
    text = sentence_of(tok, args.tokens)
    enc = loaded.encode(text)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad():
        target = int(model(**enc).logits[0].argmax())
    special = torch.tensor([t in tok.all_special_ids for t in ids[0].tolist()])
    base_ids = torch.where(special, ids[0], torch.tensor(tok.pad_token_id))[None]

    def hl_ig():
        return torch.tensor(headlab.explain(loaded, text, target=target, methods=("integrated_gradients",),
                                            ig_steps=args.steps, backend="sdpa", ig_batch_size=args.steps,
                                            warn=False).scores["integrated_gradients"])

    def hl_loo():
        return torch.tensor(headlab.explain(loaded, text, target=target, methods=("leave_one_out",), loo="unk",
                                            backend="sdpa").scores["leave_one_out"])

    def forward_logit(input_ids, attention_mask):
        return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, target]

    def forward_prob(input_ids, attention_mask):
        return torch.softmax(model(input_ids=input_ids, attention_mask=attention_mask).logits, -1)[:, target]

    lig = LayerIntegratedGradients(forward_logit, model.get_input_embeddings())

    def captum_ig():
        a = lig.attribute(ids, baselines=base_ids, additional_forward_args=(mask,), n_steps=args.steps,
                          method="gausslegendre", internal_batch_size=args.steps)
        return a[0].sum(-1).detach()

    fa = FeatureAblation(forward_prob)
    feature_mask = torch.arange(ids.shape[1])[None]

    def captum_loo():
        with torch.no_grad():
            a = fa.attribute(ids, baselines=tok.unk_token_id, additional_forward_args=(mask,),
                             feature_mask=feature_mask, perturbations_per_eval=ids.shape[1])
        return a[0].abs()

    rows = []
    h_ig, t_hig = timed(hl_ig, args.repeats)
    h_loo, t_hloo = timed(hl_loo, args.repeats)
    for impl in ("sdpa", "eager"):
        model.config._attn_implementation = impl
        c_ig, t_cig = timed(captum_ig, args.repeats)
        c_loo, t_cloo = timed(captum_loo, args.repeats)
        keep = ~special
        rows.append({"captum_path": impl, "ig_rel_diff": rel_diff(h_ig, c_ig), "ig_headlab_s": t_hig, "ig_captum_s": t_cig,
                     "ig_time_over_captum": t_hig / t_cig,
                     "loo_rel_diff": rel_diff(h_loo[keep], c_loo[keep]), "loo_headlab_s": t_hloo,
                     "loo_captum_s": t_cloo, "loo_time_over_captum": t_hloo / t_cloo})
    model.config._attn_implementation = "eager"
    print(f"model {args.model}; {ids.shape[1]} tokens; target {target}; IG {args.steps} Gauss-Legendre steps; "
          f"torch threads {args.threads}")
    print(f"{'captum on HF':<13} {'IG rel diff':>12} {'IG headlab s':>13} {'IG captum s':>12} {'time / captum':>14} "
          f"{'LOO rel diff':>13} {'LOO headlab s':>14} {'LOO captum s':>13} {'time / captum':>14}")
    for r in rows:
        print(f"{r['captum_path']:<13} {r['ig_rel_diff']:>12.2e} {r['ig_headlab_s']:>13.3f} {r['ig_captum_s']:>12.3f} "
              f"{r['ig_time_over_captum']:>14.2f} {r['loo_rel_diff']:>13.2e} {r['loo_headlab_s']:>14.3f} "
              f"{r['loo_captum_s']:>13.3f} {r['loo_time_over_captum']:>14.2f}")
    ok = all(r["ig_rel_diff"] < 1e-4 and r["loo_rel_diff"] < 1e-4 for r in rows)
    print("equal attributions (relative difference < 1e-4):", "yes" if ok else "NO")
    path = write_json("saliency_captum", {"model": args.model, "tokens": int(ids.shape[1]), "steps": args.steps,
                                          "target": target, "text": text, "rows": rows, "equal": ok})
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
