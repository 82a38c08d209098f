"""What :func:`~headlab.interpret.heads.ablation.ablate` does, laid out before it runs: its checks, batches,
configurations and bootstrap draws (:class:`AblationPlan`), and the pieces the study runner's units put together
(:class:`~headlab.interpret.heads.units.AblationUnits`): a batch's per-example effects, the pairs chosen from the
single effects, the CKA of the pair heads, and the result with its verdicts
(:class:`~headlab.interpret.heads.ablation.AblationResult`).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from headlab.errors import ConfigError, InputError
from headlab.interpret.heads import examples as C
from headlab.interpret.heads.ablation import AblationResult, head_verdicts
from headlab.interpret.heads.ablation_stats import bootstrap, check_bootstrap, collect_z, config_masks, linear_cka
from headlab.interpret.heads.edits import KINDS, Runner, mean_z
from headlab.models.loader import resolve


def check_k(k) -> None:
    """:class:`~headlab.errors.ConfigError` unless ``k`` (the heads whose pairs are measured) is an integer >= 2."""
    if not isinstance(k, int) or k < 2:
        raise ConfigError(f"k (heads whose pairs are measured) must be an integer >= 2, got {k!r}")


def check_heads(adapter, heads, counts) -> list[tuple[int, int]]:
    """``heads`` as (layer, head) pairs checked against the model (``counts``: each layer's heads); None: every head."""
    if heads is None:
        return [(l, h) for l in range(adapter.n_layers) for h in range(counts[l])]
    out = []
    for item in heads:
        try:
            l, h = (int(x) for x in item)
        except (TypeError, ValueError):
            raise ConfigError(f"heads must be (layer, head) pairs, got {item!r}") from None
        if not 0 <= l < adapter.n_layers or not 0 <= h < counts[l]:
            raise ConfigError(
                f"head ({l}, {h}) out of range: {adapter.n_layers} layers, layer {l if 0 <= l < adapter.n_layers else '?'} "
                f"has {counts[l] if 0 <= l < adapter.n_layers else '?'} heads"
            )
        out.append((l, h))
    return out


class AblationPlan:
    """:func:`ablate`'s work laid out before it runs (its checks, batches, configurations and bootstrap draws),
    with the pieces both :func:`ablate` and the study runner's units (one batch each) put together: a batch's
    per-example effects (:meth:`measure`), the pairs chosen from the single effects (:meth:`pairs_of`), the CKA
    (:meth:`cka_grid`) and the result (:meth:`result`)."""

    def __init__(
        self,
        loaded,
        texts,
        labels=None,
        *,
        kind: str,
        loss,
        heads=None,
        pairs=None,
        k: int,
        keep_one: bool,
        mean_over: str = "token",
        batch_size: int,
        max_rows: int = 128,
        n_boot: int,
        alpha: float = 0.05,
        rel_tol: float = 0.01,
        cka: bool = True,
        max_cka_tokens: int = 4096,
        seed: int = 0,
        backend: str = "auto",
        max_length: int | None = None,
    ) -> None:
        adapter, ld = resolve(loaded)
        if kind not in KINDS:
            raise ConfigError(f"unknown ablation kind {kind!r}; use one of {', '.join(KINDS)}")
        check_bootstrap(n_boot, alpha)
        loss = C.choose_loss(adapter, loss, labels)
        C.check_data(texts, labels, loss)
        if kind == "resample" and len(texts) < 2:
            raise InputError("kind='resample' takes each head's output from another example: give at least 2 texts")
        check_k(k)
        self.adapter, self.ld, self.kind, self.loss, self.backend = adapter, ld, kind, loss, backend
        self.mean_over, self.max_rows, self.k, self.keep_one, self.explicit_pairs = (
            mean_over,
            max_rows,
            k,
            keep_one,
            pairs,
        )
        self.n_boot, self.alpha, self.rel_tol, self.cka, self.max_cka_tokens = (
            n_boot,
            alpha,
            rel_tol,
            cka,
            max_cka_tokens,
        )
        counts_h = adapter.layer_heads
        self.single_heads = check_heads(adapter, heads, counts_h)
        # examples of similar length share a batch (little padding), except for resample, whose donor is
        # the next example of the same batch
        self.data = C.batches(
            ld, adapter, texts, labels, batch_size, max_length=max_length, min_size=2, by_length=kind != "resample"
        )
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
            means = (
                mean_z(self.adapter, self.data, over=self.mean_over, backend=self.backend)
                if self.kind == "mean"
                else None
            )
            self._runner = Runner(
                self.adapter,
                kind=self.kind,
                loss=self.loss,
                backend=self.backend,
                means=means,
                max_rows=self.max_rows,
                causal=C.is_causal(self.adapter),
            )
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
            if pair_heads and all(
                store.get(hd) is not None and store[hd].shape[0] >= self.max_cka_tokens for hd in pair_heads
            ):
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
        for a, b in pair_list:
            v = (
                linear_cka(zs[a], zs[b], w_o[a[0]][a[1]], w_o[b[0]][b[1]])
                if C.same_tokens(self.adapter, a[0], b[0])
                else float("nan")
            )  # an encoder head and a decoder head share no rows: not measured
            cka_t[pos[a], pos[b]] = cka_t[pos[b], pos[a]] = v
        return cka_t

    def result(
        self,
        d_all: np.ndarray,
        base: np.ndarray,
        acc: np.ndarray | None,
        pair_heads,
        pair_list,
        d_pair: np.ndarray | None,
        cka_t: torch.Tensor | None,
        seconds: dict,
    ) -> AblationResult:
        """The effects, intervals, noise floor, threshold and verdicts from the per-example effects."""
        adapter, N, alpha, boot = self.adapter, self.N, self.alpha, self.boot
        L, H, single_heads = adapter.n_layers, adapter.n_heads, self.single_heads
        d_single, d_keep = d_all[: self.n_single], d_all[self.n_single :]
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
        verdicts = head_verdicts(single_heads, single, single_ci, pair_heads, inter, inter_ci, cka_t, threshold)
        thresholds = {
            "threshold": threshold,
            "noise_floor": None if np.isnan(floor) else floor,
            "rel_tol": self.rel_tol,
            "scale": scale,
            "interval": f"{100 * (1 - alpha):.0f}% bootstrap over examples, {self.n_boot} resamples",
            "clear_single": "CI lower end > 0 and E(h) > threshold (or CI upper end < 0 and -E(h) > threshold)",
            "redundant": "I(h, g) = E(h,g) - E(h) - E(g): CI lower end > 0 and I > threshold",
        }
        kind, mean_over = self.kind, self.mean_over
        name = self.ld.name if self.ld is not None else type(adapter.model).__name__
        notes = [
            f"kind={kind}"
            + (f" (mean over {mean_over}s of the set)" if kind == "mean" else "")
            + f"; effects are increases of the {loss} loss, averaged over {N} examples"
        ]
        if N < 2:
            notes.append(
                "one example: no interval and no noise floor can be estimated (a bootstrap over examples "
                "needs at least 2), so they are reported as n/a and the verdicts compare point estimates "
                "with rel_tol x scale alone; give more examples for intervals"
            )
        return AblationResult(
            name,
            kind,
            mean_over if kind == "mean" else None,
            loss,
            N,
            float(base.mean()),
            None if acc is None else float(acc.mean()),
            single,
            single_ci,
            keep_t,
            keep_ci_t,
            pair_heads,
            pair_eff,
            inter,
            inter_ci,
            cka_t,
            floor,
            threshold,
            thresholds,
            verdicts,
            seconds,
            notes,
        )


__all__ = ["AblationPlan", "check_heads", "check_k"]
