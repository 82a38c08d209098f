"""The corpus tables of the study, computed from its per-instance records.

- ``kendall``: per method, Kendall tau of attention with it over instances: mean, std, quantiles,
  the share with a significant correlation (p < 0.05), and the same split by predicted class;
  ``pairs`` gives the mean tau of every pair of methods.
- ``permutation``: the median output TVD under 100 permutations, overall and per bin of the
  largest attention weight (Jain and Wallace's scatter, as a table).
- ``adversarial``: the largest JSD reachable within the TVD budget: mean, median, quantiles, share
  above 0.5 and 0.69 (ln 2, the maximum, is about 0.693).
- ``faithfulness``: per method (and the random ranking), ERASER comprehensiveness and sufficiency at
  10/20/50% and their AOPCs, each a mean with a percentile bootstrap 95% interval over instances.
- ``completeness``: IG's relative gap: median, max, share above 1%.
- ``accuracy``: predictions against the dataset's labels.
"""

from __future__ import annotations

import math

import numpy as np

from headlab.interpret.saliency.faithfulness import REPORT_BINS

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
MAX_ATTENTION_BINS = (0.0, 0.25, 0.5, 0.75, 1.0000001)


def _finite(xs) -> np.ndarray:
    a = np.asarray([x for x in xs if x is not None], dtype=float)
    return a[np.isfinite(a)]


def describe(xs) -> dict:
    a = _finite(xs)
    if len(a) == 0:
        return {"n": 0}
    q = np.quantile(a, QUANTILES)
    return {
        "n": int(len(a)),
        "mean": float(a.mean()),
        "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
        **{f"q{int(100 * p)}": float(v) for p, v in zip(QUANTILES, q)},
    }


def bootstrap_mean(xs, n: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """Mean with a percentile bootstrap interval (resampling instances)."""
    a = _finite(xs)
    if len(a) == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    rng = np.random.default_rng(seed)
    means = a[rng.integers(0, len(a), size=(n, len(a)))].mean(1) if n > 0 else np.array([a.mean()])
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return {"mean": float(a.mean()), "lo": float(lo), "hi": float(hi), "n": int(len(a))}


def summarize(records: list[dict], opts) -> dict:
    methods = [m for m in opts.methods]
    out: dict = {"n": len(records)}
    labelled = [r for r in records if r.get("label") is not None]
    if labelled:
        out["accuracy"] = sum(r["pred"] == r["label"] for r in labelled) / len(labelled)
    # -- Kendall tau: attention against each method, and every pair ---------------------------------
    if "attention" in methods:
        kt = {}
        for m in methods:
            if m == "attention":
                continue
            key = f"attention|{m}"
            vals = [(r["tau"].get(key) or [None, None]) + [r["pred"]] for r in records]
            taus = [v[0] for v in vals]
            sig = [v[1] is not None and v[1] < 0.05 for v in vals if v[0] is not None]
            by_class = {}
            for c in sorted({v[2] for v in vals}):
                sub = [v for v in vals if v[2] == c]
                d = describe([v[0] for v in sub])
                d["significant"] = sum(v[1] is not None and v[1] < 0.05 for v in sub if v[0] is not None) / max(
                    1, sum(v[0] is not None for v in sub)
                )
                by_class[str(c)] = d
            kt[m] = {**describe(taus), "significant": sum(sig) / max(1, len(sig)), "by_class": by_class}
        out["kendall"] = kt
    pairs = {}
    for r in records[:1]:
        for key in r["tau"]:
            pairs[key] = describe([(x["tau"].get(key) or [None])[0] for x in records])
    out["pairs"] = pairs
    # -- permutation and adversarial --------------------------------------------------------------------
    perm = [r["permutation"] for r in records if r.get("permutation")]
    if perm:
        bins = []
        for lo, hi in zip(MAX_ATTENTION_BINS[:-1], MAX_ATTENTION_BINS[1:]):
            sub = [p["median_tvd"] for p in perm if lo <= p["max_attention"] < hi]
            bins.append(
                {
                    "max_attention": [lo, min(hi, 1.0)],
                    "n": len(sub),
                    "median_tvd": float(np.median(sub)) if sub else None,
                }
            )
        out["permutation"] = {
            "median_tvd": describe([p["median_tvd"] for p in perm]),
            "max_attention": describe([p["max_attention"] for p in perm]),
            "bins": bins,
            "share_below_0.01": float(np.mean([p["median_tvd"] < 0.01 for p in perm])),
        }
    adv = [r["adversarial"] for r in records if r.get("adversarial")]
    if adv:
        j = _finite([a["max_jsd"] for a in adv])
        out["adversarial"] = {
            "max_jsd": describe(j),
            "share_above_0.5": float(np.mean(j > 0.5)),
            "share_above_0.69": float(np.mean(j > 0.69)),
            "tvd_budget": opts.tvd_budget,
        }
    # -- ERASER --------------------------------------------------------------------------------------------
    faith = {}
    names = [m for m in [*methods, "random"] if any(m in r.get("eraser", {}) for r in records)]
    for i, m in enumerate(names):
        rows = [r["eraser"][m] for r in records if m in r.get("eraser", {})]
        entry = {}
        for k in REPORT_BINS:
            entry[f"comprehensiveness@{k}"] = bootstrap_mean(
                [x["comprehensiveness"][str(k)] for x in rows], opts.bootstrap, opts.seed + i
            )
            entry[f"sufficiency@{k}"] = bootstrap_mean(
                [x["sufficiency"][str(k)] for x in rows], opts.bootstrap, opts.seed + i
            )
        entry["aopc_comprehensiveness"] = bootstrap_mean(
            [x["aopc_comprehensiveness"] for x in rows], opts.bootstrap, opts.seed + i
        )
        entry["aopc_sufficiency"] = bootstrap_mean([x["aopc_sufficiency"] for x in rows], opts.bootstrap, opts.seed + i)
        faith[m] = entry
    out["faithfulness"] = faith
    gaps = _finite([r.get("completeness_gap") for r in records])
    if len(gaps):
        out["completeness"] = {
            "median": float(np.median(gaps)),
            "max": float(gaps.max()),
            "share_above_1pct": float(np.mean(gaps > 0.01)),
        }
    return out


def fmt_ci(e: dict, digits: int = 3) -> str:
    if not e or e.get("mean") is None:
        return "-"
    return f"{e['mean']:.{digits}f} [{e['lo']:.{digits}f}, {e['hi']:.{digits}f}]"


def fmt(x, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"
