"""Which heads matter, measured: single, joint and keep-one-per-layer ablation, with verdicts.

``E(S)`` is the mean over examples of ``L_S(x) - L(x)``: the increase of the loss (see
:mod:`headlab.interpret.heads.examples`) when the heads in S are ablated (kind: :mod:`.edits`).

- single effects ``E(h)`` for every head (or ``heads=``);
- joint effects ``E(h, g)`` for every pair among the ``k`` heads with the smallest single effect
  (k = 16: 120 pairs), or ``pairs=``; the interaction ``I(h, g) = E(h, g) - E(h) - E(g)``;
- keep-one-per-layer: each layer reduced to one head h (all its other heads ablated), Michel et
  al.'s "a layer with a single head";
- 95% bootstrap intervals over examples (``n_boot`` resamples of the examples, the same for every
  quantity, so interactions are paired), and a *noise floor*: the median half-width of the single
  effects' intervals, the smallest effect this set can tell from sampling noise. The threshold a
  verdict uses is ``max(noise floor, rel_tol * scale)``, with scale the unablated loss (task, lm)
  or the largest single effect (kl, cosine, whose unablated value is 0).

Verdicts, per head (evidence and thresholds with each):

==================  ==========================================================================
unique              a clear single effect: the interval's lower end above 0 and E(h) above the
                    threshold (or, with the sign reversed, ablating it clearly *lowers* the loss,
                    which the evidence says: Kovaleva et al. 2019 saw such heads)
redundant with g    no clear single effect, but an interaction with partner g whose interval's
                    lower end is above 0 and whose value is above the threshold: removing both
                    costs more than the two alone. The strongest such g is named, with the linear
                    CKA of the two heads' outputs head_out over the set
unused              no clear single effect and no such interaction with any of the k partners
untested            no clear single effect, but not among the k heads whose pairs were measured
==================  ==========================================================================
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from headlab.errors import ConfigError, InputError
from headlab.interpret.heads import examples as C
from headlab.interpret.heads.ablation_stats import (
    MAX_BOOT,
    bootstrap,
    check_bootstrap,
    collect_z,
    config_masks,
    linear_cka,
)
from headlab.interpret.heads.edits import KINDS, Runner, mean_z
from headlab.models.loader import resolve
from headlab.progress import Progress, reporter
from headlab.results import envelope, read_json, write_json


@dataclass
class Verdict:
    layer: int
    head: int
    verdict: str  # unique / redundant / unused / untested
    partner: tuple[int, int] | None  # the g of "redundant with g"
    evidence: str

    def label(self) -> str:
        if self.verdict != "redundant":
            return self.verdict
        assert self.partner is not None  # a redundant head names its partner
        return f"redundant with {self.partner[0]}.{self.partner[1]}"


@dataclass
class AblationResult:
    """Every measured effect, its interval, and the verdicts. Grids are ``(n_layers, H)``."""

    model: str
    kind: str
    mean_over: str | None  # for kind="mean": "token" or "position"
    loss: str
    n_examples: int
    baseline: float  # mean unablated loss
    baseline_accuracy: float | None
    single: torch.Tensor  # (n_layers, H) E(h); NaN where not measured
    single_ci: torch.Tensor  # (n_layers, H, 2)
    keep_one: torch.Tensor | None  # (n_layers, H): E(all heads of the layer but h)
    keep_one_ci: torch.Tensor | None
    pair_heads: list[tuple[int, int]]  # the k heads whose pairs were measured
    pair_effect: torch.Tensor  # (k, k) E(h, g); NaN on the diagonal / unmeasured
    interaction: torch.Tensor  # (k, k) E(h, g) - E(h) - E(g)
    interaction_ci: torch.Tensor  # (k, k, 2)
    cka: torch.Tensor | None  # (k, k) linear CKA of head_out
    noise_floor: float
    threshold: float
    thresholds: dict
    verdicts: list[Verdict]
    seconds: dict = field(default_factory=dict)  # per phase
    notes: list[str] = field(default_factory=list)


    def _repr_html_(self) -> str:
        """This result's page inline in a notebook (headlab's shell in a sandboxed frame; no network)."""
        from headlab.interpret import shell
        from headlab.interpret.heads.page import render_page

        return shell.inline(render_page(title=f"heads: {self.model}", ablation=self))
    def floor_text(self) -> str:
        """The noise floor for people: ``"0.00075"``, or ``"n/a (1 example)"`` when it cannot be estimated."""
        return f"n/a ({self.n_examples} example)" if np.isnan(self.noise_floor) else f"{self.noise_floor:.3g}"

    def counts(self) -> dict[str, int]:
        out = {"unique": 0, "redundant": 0, "unused": 0, "untested": 0}
        for v in self.verdicts:
            out[v.verdict] += 1
        return out

    def verdict_of(self, layer: int, head: int) -> Verdict | None:
        return next((v for v in self.verdicts if (v.layer, v.head) == (layer, head)), None)

    def to_json(self) -> dict:
        """The result in headlab's envelope (kind ``head_ablation``); beside the header the keys files have always
        had (``kind`` is the ablation's kind there). NaN (not measured) is written as null."""
        def arr(t):
            return None if t is None else np.where(np.isnan(t.numpy()), None, np.round(t.numpy(), 8)).tolist()

        return envelope("head_ablation", {"kind_of_result": "head_ablation", "model": self.model, "kind": self.kind,
                "mean_over": self.mean_over, "loss": self.loss, "n_examples": self.n_examples,
                "baseline": self.baseline, "baseline_accuracy": self.baseline_accuracy,
                "single": arr(self.single), "single_ci": arr(self.single_ci), "keep_one": arr(self.keep_one),
                "keep_one_ci": arr(self.keep_one_ci), "pair_heads": [list(p) for p in self.pair_heads],
                "pair_effect": arr(self.pair_effect), "interaction": arr(self.interaction),
                "interaction_ci": arr(self.interaction_ci), "cka": arr(self.cka),
                "noise_floor": None if np.isnan(self.noise_floor) else self.noise_floor,
                "threshold": self.threshold, "thresholds": self.thresholds, "counts": self.counts(),
                "verdicts": [{"layer": v.layer, "head": v.head, "verdict": v.verdict, "label": v.label(),
                              "partner": list(v.partner) if v.partner else None, "evidence": v.evidence}
                             for v in self.verdicts], "seconds": self.seconds, "notes": self.notes},
            model=self.model, settings={"kind": self.kind, "mean_over": self.mean_over, "loss": self.loss})

    @classmethod
    def from_json(cls, d: dict) -> AblationResult:
        """The result from its JSON: this version's envelope or an earlier file (the same keys, no header)."""
        try:
            K = len(d["pair_heads"])
            L, H = np.asarray(d["single"], dtype=float).shape
            verdicts = [Verdict(int(v["layer"]), int(v["head"]), v["verdict"],
                                tuple(v["partner"]) if v.get("partner") else None, v["evidence"]) for v in d["verdicts"]]
            return cls(d["model"], d["kind"], d.get("mean_over"), d["loss"], int(d["n_examples"]), float(d["baseline"]),
                       d.get("baseline_accuracy"), _grid(d["single"], (L, H)), _grid(d["single_ci"], (L, H, 2)),  # type: ignore[arg-type]  # required grids: never null in a written file
                       _grid(d.get("keep_one"), (L, H)), _grid(d.get("keep_one_ci"), (L, H, 2)),
                       [tuple(p) for p in d["pair_heads"]], _grid(d["pair_effect"], (K, K)),  # type: ignore[arg-type]  # as above
                       _grid(d["interaction"], (K, K)), _grid(d["interaction_ci"], (K, K, 2)), _grid(d.get("cka"), (K, K)),  # type: ignore[arg-type]  # as above
                       float("nan") if d.get("noise_floor") is None else float(d["noise_floor"]), float(d["threshold"]),
                       d.get("thresholds", {}), verdicts, d.get("seconds", {}), d.get("notes", []))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"not an ablation result (headlab heads ablate's ablation.json): {type(e).__name__} "
                             f"{e}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_json` to ``path`` (atomically, :func:`headlab.results.write_json`)."""
        return write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> AblationResult:
        """An ablation result saved by :meth:`save` or ``headlab heads ablate --out`` (earlier files too)."""
        return cls.from_json(read_json(path, what="an ablation.json (headlab heads ablate --out)"))


def _grid(x, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A float32 tensor of ``shape`` from nested lists whose nulls are NaN (None stays None)."""
    return None if x is None else torch.from_numpy(np.array(x, dtype=np.float64).reshape(shape)).float()


def _check_heads(adapter, heads, counts) -> list[tuple[int, int]]:
    if heads is None:
        return [(l, h) for l in range(adapter.n_layers) for h in range(counts[l])]
    out = []
    for item in heads:
        try:
            l, h = (int(x) for x in item)
        except (TypeError, ValueError):
            raise ConfigError(f"heads must be (layer, head) pairs, got {item!r}") from None
        if not 0 <= l < adapter.n_layers or not 0 <= h < counts[l]:
            raise ConfigError(f"head ({l}, {h}) out of range: {adapter.n_layers} layers, layer {l if 0 <= l < adapter.n_layers else '?'} "
                              f"has {counts[l] if 0 <= l < adapter.n_layers else '?'} heads")
        out.append((l, h))
    return out


def ablate(loaded, texts, labels=None, *, kind: str = "zero", loss: C.Loss = "auto", heads=None, pairs=None,
           k: int = 16, keep_one: bool = True, mean_over: str = "token", batch_size: int = 16,
           max_rows: int = 128, n_boot: int = 1000, alpha: float = 0.05, rel_tol: float = 0.01,
           cka: bool = True, max_cka_tokens: int = 4096, seed: int = 0, backend: str = "auto",
           max_length: int | None = None, progress: bool | Progress = False) -> AblationResult:
    """Single, pairwise and keep-one-per-layer ablation effects with intervals and verdicts.

    Args:
        loaded: a LoadedModel, a model or an adapter. texts, labels: as :func:`headlab.head_importance`.
        kind: ``"zero"``, ``"mean"``, ``"resample"`` or ``"uniform"`` (see :mod:`.edits`).
        heads: (layer, head) pairs to ablate singly (default: every head).
        pairs: explicit ((l, h), (l2, g)) pairs (default: every pair among the ``k`` lowest single effects).
        keep_one: also measure each layer reduced to one head.
        mean_over: for ``kind="mean"``: ``"token"`` (one mean vector per head) or ``"position"``.
        max_rows: rows per forward (configurations x examples batched together).
        n_boot, alpha: bootstrap resamples and interval level; rel_tol: see the module docstring.
    """
    plan = AblationPlan(loaded, texts, labels, kind=kind, loss=loss, heads=heads, pairs=pairs, k=k, keep_one=keep_one,
                        mean_over=mean_over, batch_size=batch_size, max_rows=max_rows, n_boot=n_boot, alpha=alpha,
                        rel_tol=rel_tol, cka=cka, max_cka_tokens=max_cka_tokens, seed=seed, backend=backend,
                        max_length=max_length)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    d_all, base, acc = _measure(plan.runner, plan.data, plan.masks, plan.N, progress, "single + keep-one"
                                if keep_one else "single ablations")
    seconds["single_and_keep_one"] = time.perf_counter() - t0
    pair_heads, pair_list = plan.pairs_of(d_all)
    t1 = time.perf_counter()
    zs_for_cka: dict = {}
    d_pair = None
    if pair_list:
        d_pair, _, _ = _measure(plan.runner, plan.data, config_masks(plan.adapter, [list(p) for p in pair_list]),
                                plan.N, progress, f"joint ablations ({len(pair_list)} pairs)",
                                cka_heads=pair_heads if cka else None, cka_store=zs_for_cka,
                                max_cka_tokens=max_cka_tokens)
    seconds["pairs"] = time.perf_counter() - t1
    cka_t = plan.cka_grid(pair_heads, pair_list, zs_for_cka) if cka and pair_heads and zs_for_cka else None
    return plan.result(d_all, base, acc, pair_heads, pair_list, d_pair, cka_t, seconds)


class AblationPlan:
    """:func:`ablate`'s work laid out before it runs (its checks, batches, configurations and bootstrap draws),
    with the pieces both :func:`ablate` and the study runner's units (one batch each) put together: a batch's
    per-example effects (:meth:`measure`), the pairs chosen from the single effects (:meth:`pairs_of`), the CKA
    (:meth:`cka_grid`) and the result (:meth:`result`)."""

    def __init__(self, loaded, texts, labels=None, *, kind: str, loss, heads=None, pairs=None, k: int, keep_one: bool,
                 mean_over: str = "token", batch_size: int, max_rows: int = 128, n_boot: int, alpha: float = 0.05,
                 rel_tol: float = 0.01, cka: bool = True, max_cka_tokens: int = 4096, seed: int = 0,
                 backend: str = "auto", max_length: int | None = None) -> None:
        adapter, ld = resolve(loaded)
        if kind not in KINDS:
            raise ConfigError(f"unknown ablation kind {kind!r}; use one of {', '.join(KINDS)}")
        check_bootstrap(n_boot, alpha)
        loss = C.choose_loss(adapter, loss, labels)
        C.check_data(texts, labels, loss)
        if kind == "resample" and len(texts) < 2:
            raise InputError("kind='resample' takes each head's output from another example: give at least 2 texts")
        if not isinstance(k, int) or k < 2:
            raise ConfigError(f"k (heads whose pairs are measured) must be an integer >= 2, got {k!r}")
        self.adapter, self.ld, self.kind, self.loss, self.backend = adapter, ld, kind, loss, backend
        self.mean_over, self.max_rows, self.k, self.keep_one, self.explicit_pairs = mean_over, max_rows, k, keep_one, pairs
        self.n_boot, self.alpha, self.rel_tol, self.cka, self.max_cka_tokens = n_boot, alpha, rel_tol, cka, max_cka_tokens
        counts_h = adapter.layer_heads
        self.single_heads = _check_heads(adapter, heads, counts_h)
        # examples of similar length share a batch (little padding), except for resample, whose donor is
        # the next example of the same batch
        self.data = C.batches(ld, adapter, texts, labels, batch_size, max_length=max_length, min_size=2,
                              by_length=kind != "resample")
        self.N = N = len(texts)
        rng = np.random.default_rng(seed)
        self.boot = rng.multinomial(N, np.full(N, 1.0 / N), size=n_boot).astype(np.float64)  # (n_boot, N)
        self.n_single = len(self.single_heads)
        self.keep_heads = [(l, h) for l in range(adapter.n_layers) for h in range(counts_h[l])] if keep_one else []
        keep_cfg = [[(l, g) for g in range(counts_h[l]) if g != h] for l, h in self.keep_heads]
        self.masks = config_masks(adapter, [[hd] for hd in self.single_heads] + keep_cfg)
        self._runner: Runner | None = None

    @property
    def runner(self) -> Runner:
        """The configurations' runner (made at first use: ``kind="mean"`` first takes the means over the set)."""
        if self._runner is None:
            means = mean_z(self.adapter, self.data, over=self.mean_over, backend=self.backend) \
                if self.kind == "mean" else None
            self._runner = Runner(self.adapter, kind=self.kind, loss=self.loss, backend=self.backend, means=means,
                                  max_rows=self.max_rows, causal=C.is_causal(self.adapter))
        return self._runner

    @property
    def n_pairs(self) -> int:
        """How many pairs the joint ablations measure (known before the single effects: which pairs is not)."""
        if self.explicit_pairs is not None:
            return len(self.explicit_pairs)
        kk = min(self.k, self.n_single)
        return kk * (kk - 1) // 2

    def measure(self, b: C.Batch, masks: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Batch ``b``'s ``(effects (n_configs, B), unablated loss (B,), accuracy (B,) or None)`` per example."""
        runner = self.runner
        clean = runner.clean(b, keep_z=runner.kind == "resample")
        lc = runner.run(b, clean, masks)  # (C, B)
        acc = None if clean["acc"] is None else clean["acc"].cpu().numpy()
        return (lc - clean["loss"][None]).double().cpu().numpy(), clean["loss"].double().cpu().numpy(), acc

    def pairs_of(self, d_all: np.ndarray) -> tuple[list[tuple[int, int]], list[tuple]]:
        """``(pair heads, pairs)``: every pair among the ``k`` lowest single effects (or the pairs given), from the
        per-example effects ``d_all`` (single and keep-one configurations by every example)."""
        e_single = d_all[: self.n_single].mean(-1)
        row_of = {hd: i for i, hd in enumerate(self.single_heads)}
        if self.explicit_pairs is None:
            order = np.argsort(e_single, kind="stable")
            pair_heads = [self.single_heads[i] for i in order[: min(self.k, self.n_single)]]
            return pair_heads, list(itertools.combinations(pair_heads, 2))
        pair_list: list[tuple] = [tuple(tuple(int(x) for x in p) for p in pr) for pr in self.explicit_pairs]
        for a, b in pair_list:
            if a not in row_of or b not in row_of:
                raise ConfigError(f"pair {a}, {b}: both heads must be among the single ablations (heads=)")
        return sorted({h for pr in pair_list for h in pr}), pair_list

    def cka_batches(self, pair_heads) -> dict:
        """The pair heads' z at real tokens, ``max_cka_tokens`` each at most, from the unablated passes."""
        store: dict = {}
        runner = self.runner
        for b in self.data:
            if pair_heads and all(store.get(hd) is not None and store[hd].shape[0] >= self.max_cka_tokens
                                  for hd in pair_heads):
                break  # every head has its tokens (the same on every rank of a group: the same data)
            clean = runner.clean(b, keep_z=True)
            collect_z(store, pair_heads, runner.every_head(clean["z"]), runner.rows_of(b), self.max_cka_tokens)
        return store

    def cka_grid(self, pair_heads, pair_list, zs: dict) -> torch.Tensor:
        """Linear CKA of the pairs' head_out ``(K, K)`` from the collected z (NaN where not measured)."""
        pos = {hd: i for i, hd in enumerate(pair_heads)}
        cka_t = torch.full((len(pair_heads), len(pair_heads)), float("nan"))
        full = self.adapter.placement.full  # a sharded W^O whole on every rank
        w_o = {l: full(self.adapter.W_O(l).detach()) for l in sorted({h[0] for h in pair_heads})}  # (H, d, E)
        for (a, b) in pair_list:
            v = linear_cka(zs[a], zs[b], w_o[a[0]][a[1]], w_o[b[0]][b[1]]) if C.same_tokens(self.adapter, a[0], b[0]) \
                else float("nan")  # an encoder head and a decoder head share no rows: not measured
            cka_t[pos[a], pos[b]] = cka_t[pos[b], pos[a]] = v
        return cka_t

    def result(self, d_all: np.ndarray, base: np.ndarray, acc: np.ndarray | None, pair_heads, pair_list,
               d_pair: np.ndarray | None, cka_t: torch.Tensor | None, seconds: dict) -> AblationResult:
        """The effects, intervals, noise floor, threshold and verdicts from the per-example effects."""
        adapter, N, alpha, boot = self.adapter, self.N, self.alpha, self.boot
        L, H, single_heads = adapter.n_layers, adapter.n_heads, self.single_heads
        d_single, d_keep = d_all[: self.n_single], d_all[self.n_single:]
        e_single, ci_single = bootstrap(d_single, boot, alpha)
        single = torch.full((L, H), float("nan"))
        single_ci = torch.full((L, H, 2), float("nan"))
        for i, (l, h) in enumerate(single_heads):
            single[l, h] = float(e_single[i])
            single_ci[l, h] = torch.from_numpy(ci_single[i])
        keep_t = keep_ci_t = None
        if self.keep_one:
            e_keep, ci_keep = bootstrap(d_keep, boot, alpha)
            keep_t, keep_ci_t = torch.full((L, H), float("nan")), torch.full((L, H, 2), float("nan"))
            for i, (l, h) in enumerate(self.keep_heads):
                keep_t[l, h], keep_ci_t[l, h] = float(e_keep[i]), torch.from_numpy(ci_keep[i])
        # the noise floor and the threshold
        half = (ci_single[:, 1] - ci_single[:, 0]) / 2
        floor = float("nan") if N < 2 else (float(np.median(half)) if len(half) else 0.0)  # NaN: not estimable
        loss = self.loss
        scale = abs(float(base.mean())) if loss in ("task", "lm") else float(np.max(np.abs(e_single), initial=0.0))
        threshold = self.rel_tol * scale if N < 2 else max(floor, self.rel_tol * scale)
        row_of = {hd: i for i, hd in enumerate(single_heads)}
        K = len(pair_heads)
        pos = {hd: i for i, hd in enumerate(pair_heads)}
        pair_eff = torch.full((K, K), float("nan"))
        inter = torch.full((K, K), float("nan"))
        inter_ci = torch.full((K, K, 2), float("nan"))
        if pair_list:
            assert d_pair is not None  # measured whenever there are pairs
            d_int = d_pair - np.stack([d_single[row_of[a]] + d_single[row_of[b]] for a, b in pair_list])
            e_pair, _ = bootstrap(d_pair, boot, alpha)
            e_int, ci_int = bootstrap(d_int, boot, alpha)
            for i, (a, b) in enumerate(pair_list):
                for x, y in ((a, b), (b, a)):
                    pair_eff[pos[x], pos[y]] = float(e_pair[i])
                    inter[pos[x], pos[y]] = float(e_int[i])
                    inter_ci[pos[x], pos[y]] = torch.from_numpy(ci_int[i])
        verdicts = _verdicts(single_heads, single, single_ci, pair_heads, inter, inter_ci, cka_t, threshold)
        thresholds = {"threshold": threshold, "noise_floor": None if np.isnan(floor) else floor, "rel_tol": self.rel_tol,
                      "scale": scale,
                      "interval": f"{100 * (1 - alpha):.0f}% bootstrap over examples, {self.n_boot} resamples",
                      "clear_single": "CI lower end > 0 and E(h) > threshold (or CI upper end < 0 and -E(h) > threshold)",
                      "redundant": "I(h, g) = E(h,g) - E(h) - E(g): CI lower end > 0 and I > threshold"}
        kind, mean_over = self.kind, self.mean_over
        name = self.ld.name if self.ld is not None else type(adapter.model).__name__
        notes = [f"kind={kind}" + (f" (mean over {mean_over}s of the set)" if kind == "mean" else "") +
                 f"; effects are increases of the {loss} loss, averaged over {N} examples"]
        if N < 2:
            notes.append("one example: no interval and no noise floor can be estimated (a bootstrap over examples "
                         "needs at least 2), so they are reported as n/a and the verdicts compare point estimates "
                         "with rel_tol x scale alone; give more examples for intervals")
        return AblationResult(name, kind, mean_over if kind == "mean" else None, loss, N, float(base.mean()),
                              None if acc is None else float(acc.mean()), single, single_ci, keep_t, keep_ci_t,
                              pair_heads, pair_eff, inter, inter_ci, cka_t, floor, threshold, thresholds, verdicts,
                              seconds, notes)


def _measure(runner: Runner, data, masks: torch.Tensor, N: int, progress: bool | Progress, label: str, *,
             cka_heads=None, cka_store=None, max_cka_tokens: int = 4096):
    """``(d (n_configs, N) effects per example, baseline (N,), accuracy (N,) or None)``; progress reports
    ``(label, configurations x batches done, of all)``."""
    d = np.zeros((masks.shape[0], N))
    base = np.zeros(N)
    acc = None
    total, done = masks.shape[0] * len(data), 0
    with reporter(progress) as say:
        say(label, 0, total)

        def advance(n: int) -> None:
            nonlocal done
            done += n
            say(label, done, total)

        for b in data:
            clean = runner.clean(b, keep_z=runner.kind == "resample" or cka_heads is not None)
            if cka_heads is not None:
                collect_z(cka_store, cka_heads, runner.every_head(clean["z"]), runner.rows_of(b), max_cka_tokens)
            lc = runner.run(b, clean, masks, advance)  # (C, B)
            idx = b.index.numpy()
            d[:, idx] = (lc - clean["loss"][None]).double().cpu().numpy()
            base[idx] = clean["loss"].double().cpu().numpy()
            if clean["acc"] is not None:
                acc = np.zeros(N) if acc is None else acc
                acc[idx] = clean["acc"].cpu().numpy()
    return d, base, acc


def _verdicts(single_heads, single, single_ci, pair_heads, inter, inter_ci, cka, thr) -> list[Verdict]:
    pos = {hd: i for i, hd in enumerate(pair_heads)}
    out = []
    for (l, h) in single_heads:
        e = float(single[l, h])
        lo, hi = (e if np.isnan(float(x)) else float(x) for x in single_ci[l, h])  # n/a: the point estimate
        if (lo > 0 and e > thr) or (hi < 0 and -e > thr):
            sign = "" if e > 0 else " (ablating it lowers the loss)"
            out.append(Verdict(l, h, "unique", None,
                               f"E={e:.4g} [{lo:.4g}, {hi:.4g}] beyond the threshold {thr:.3g}{sign}"))
            continue
        if (l, h) not in pos:
            out.append(Verdict(l, h, "untested", None,
                               f"E={e:.4g} [{lo:.4g}, {hi:.4g}] within the threshold {thr:.3g}; "
                               "not among the heads whose pairs were measured"))
            continue
        i = pos[(l, h)]
        row = inter[i].clone()
        row_lo = torch.where(torch.isnan(inter_ci[i, :, 0]), row, inter_ci[i, :, 0])  # n/a: the point estimate
        ok = (row_lo > 0) & (row > thr)
        if bool(ok.any()):
            j = int(torch.where(ok, row, torch.full_like(row, -float("inf"))).argmax())
            g = pair_heads[j]
            sim = f", CKA(head_out)={float(cka[i, j]):.2f}" if cka is not None else ""
            out.append(Verdict(l, h, "redundant", g,
                               f"E={e:.4g} alone; with {g[0]}.{g[1]}: I={float(row[j]):.4g} "
                               f"[{float(inter_ci[i, j, 0]):.4g}, {float(inter_ci[i, j, 1]):.4g}] > {thr:.3g}{sim}"))
        else:
            best = float(torch.nan_to_num(row, nan=-float("inf")).max()) if len(row) else float("nan")
            out.append(Verdict(l, h, "unused", None,
                               f"E={e:.4g} [{lo:.4g}, {hi:.4g}] within {thr:.3g}; largest interaction with the "
                               f"{len(pair_heads) - 1} partners {best:.4g}, none clearly above {thr:.3g}"))
    return out


__all__ = ["MAX_BOOT", "AblationPlan", "AblationResult", "Verdict", "ablate", "check_bootstrap", "config_masks",
           "linear_cka"]
