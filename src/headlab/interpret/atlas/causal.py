"""Causal checks of the atlas's labels: gate off the top-k heads of a kind, and k random heads, on the kind's task.

A label is only as good as the causal check behind it (REFERENCES section 12). For a kind with a task,
the check runs ``1 + n_draws`` configurations, each a set of k heads whose outputs z are zeroed (gate 0):
the k highest-scoring heads of the kind, and ``n_draws`` sets of k heads drawn uniformly from the other
heads. Configurations run batched: ``c`` configurations of ``B`` examples are one forward of ``c * B``
rows, an edit at every layer's ``z`` site zeroing, in the rows of configuration c, the heads c gates off.

The *effect* of a configuration on example x is how much worse the task gets, ``m_gated(x) - m(x)`` for a
loss (induction, duplicate and previous-token: the loss on the repeated half; sink and local: the
log-perplexity of real text, or ``1 - cos`` of a sentence encoder's pooled embedding; syntactic: the
loss on the first tokens of the treebank words in the top heads' relations, :mod:`.dependents`) and ``m(x) -
m_gated(x)`` for an accuracy (retrieval: needle accuracy). :func:`verdict` decides, from the
per-example effects alone (kept in the JSON, so the verdict can be recomputed):

- *targeted* = mean effect of the top-k set, with a percentile bootstrap interval over examples;
- each random draw's mean effect and interval (the same resamples); *random mean* = the mean of the draws;
- **causal** when targeted >= ``ratio`` (3) x max(random mean, 0) and targeted > 0, and the targeted
  interval's lower end lies above every random draw's upper end; otherwise **not confirmed**.

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> targeted = 1.0 + 0.1 * rng.standard_normal(20)          # per-example effects of the top-k set
    >>> draws = 0.05 + 0.1 * rng.standard_normal((10, 20))       # 10 random draws
    >>> verdict(targeted, draws, n_boot=200, seed=0)["verdict"]
    'causal'
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from headlab.errors import ConfigError
from headlab.models.tensor_parallel import by_heads


def verdict(targeted, draws, *, n_boot: int = 1000, alpha: float = 0.05, ratio: float = 3.0, seed: int = 0) -> dict:
    """The verdict and its numbers from per-example effects: ``targeted`` ``(N,)``, ``draws`` ``(D, N)``."""
    t = np.asarray(targeted, dtype=np.float64)
    d = np.asarray(draws, dtype=np.float64).reshape(-1, len(t))
    N = len(t)
    if N < 2:
        raise ConfigError(f"a causal check needs at least 2 examples for its bootstrap interval, got {N}")
    counts = np.random.default_rng(seed).multinomial(N, np.full(N, 1.0 / N), size=n_boot).astype(np.float64)
    boots = np.vstack([t[None], d]) @ counts.T / N  # (1 + D, n_boot)
    lo, hi = np.percentile(boots, [100 * alpha / 2, 100 * (1 - alpha / 2)], axis=1)
    t_mean, d_means = float(t.mean()), d.mean(1)
    r_mean = float(d_means.mean()) if len(d_means) else 0.0
    r_hi = float(hi[1:].max()) if len(d_means) else 0.0
    ok_ratio = t_mean > 0 and t_mean >= ratio * max(r_mean, 0.0)
    ok_ci = float(lo[0]) > r_hi
    times = t_mean / r_mean if r_mean > 0 else None
    return {
        "verdict": "causal" if ok_ratio and ok_ci else "not confirmed",
        "targeted": t_mean,
        "targeted_ci": [float(lo[0]), float(hi[0])],
        "random": d_means.tolist(),
        "random_ci": np.stack([lo[1:], hi[1:]], -1).tolist(),
        "random_mean": r_mean,
        "random_max_upper": r_hi,
        "times_random": times,
        "passes_ratio": bool(ok_ratio),
        "clears_random": bool(ok_ci),
        "rule": f"causal when targeted >= {ratio:g} x max(random mean, 0), targeted > 0, and the targeted "
        f"{100 * (1 - alpha):.0f}% bootstrap interval's lower end is above every random draw's upper end",
        "n_boot": n_boot,
        "alpha": alpha,
        "ratio": ratio,
        "seed": seed,
    }


def draw_sets(
    n_layers: int, layer_heads: list[int], top: list[tuple[int, int]], *, n_draws: int, seed: int
) -> list[list[tuple[int, int]]]:
    """``n_draws`` sets of ``len(top)`` heads drawn without replacement from the heads not in ``top``
    (from every head when too few are left)."""
    every = [(l, h) for l in range(n_layers) for h in range(layer_heads[l])]
    pool = [x for x in every if x not in set(top)]
    if len(pool) < len(top):
        pool = every
    rng = np.random.default_rng(seed)
    return [[pool[i] for i in sorted(rng.choice(len(pool), size=len(top), replace=False))] for _ in range(n_draws)]


def gated(
    adapter, inputs: dict, configs: torch.Tensor, metric: Callable, *, max_rows: int = 32, max_tokens: int = 4096
) -> torch.Tensor:
    """``(C, B)``: ``metric(outputs, inputs) -> (rows,)`` with each configuration's heads gated off.

    ``inputs``: ``input_ids`` and ``attention_mask`` ``(B, L)``; ``configs``: bool ``(C, n_layers, H)``
    (an all-False configuration is the ungated model). A forward holds at most ``max_rows`` rows and
    ``max_tokens`` tokens (a language model's logits are ``rows x L x vocab``). The edit treats each head by
    itself (:class:`~headlab.models.tensor_parallel.by_heads`): on a sharded model each rank zeroes the heads
    it holds and nothing moves between ranks."""
    B, L = (int(x) for x in inputs["input_ids"].shape)
    per = max(1, min(max_rows, max_tokens // max(L, 1)) // B)
    out = []
    for s in range(0, configs.shape[0], per):
        chunk = configs[s : s + per]
        c = chunk.shape[0]
        rep = {k: v.repeat(c, *([1] * (v.dim() - 1))) for k, v in inputs.items()}

        def make(layer):
            def edit(z, site, heads):  # z (c*B, heads, L, d): every head, or this rank's under tensor parallelism
                keep = (~chunk[:, layer, heads.start : heads.stop]).to(z.dtype).repeat_interleave(B, 0)  # (c*B, heads)
                return z * keep[:, :, None, None].to(z.device)

            return by_heads(edit)

        with torch.no_grad(), adapter.hooks({adapter.site_name(l, "z"): make(l) for l in range(adapter.n_layers)}):
            o = adapter.forward(rep)
        out.append(metric(o, rep).reshape(c, B).double().cpu())
    return torch.cat(out)


def _logits(out) -> torch.Tensor:
    lg = getattr(out, "logits", None)
    if lg is None:
        raise ConfigError(f"the model returns no logits ({type(out).__name__})")
    return lg.float()


def span_loss(first: int, stop: int) -> Callable:
    """Metric: mean next-token NLL of the tokens at positions ``first..stop-1`` (the repeated half)."""

    def metric(out, inputs):
        lg = _logits(out)[:, first - 1 : stop - 1]  # rows predicting positions first..stop-1
        tgt = inputs["input_ids"][:, first:stop]
        return F.cross_entropy(lg.transpose(1, 2), tgt, reduction="none").mean(-1)

    return metric


def target_loss(targets: torch.Tensor) -> Callable:
    """Metric: per row, the mean next-token NLL of the tokens at the positions ``targets`` ``(B, L)`` (bool)
    marks, each predicted from the logits one position before (position 0 is never scored): the syntactic
    task's loss on dependents (:mod:`.dependents`)."""

    def metric(out, inputs):
        lg = _logits(out)[:, :-1]
        nll = F.cross_entropy(lg.transpose(1, 2), inputs["input_ids"][:, 1:], reduction="none")  # (rows, L - 1)
        keep = targets[:, 1:].to(nll.device).repeat(nll.shape[0] // targets.shape[0], 1).to(nll.dtype)
        return (nll * keep).sum(-1) / keep.sum(-1).clamp_min(1.0)

    return metric


def text_loss(out, inputs) -> torch.Tensor:
    """Metric: mean next-token NLL over the real tokens (log-perplexity)."""
    lg = _logits(out)
    ids, m = inputs["input_ids"], inputs["attention_mask"].bool()
    nll = F.cross_entropy(lg[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    keep = (m[:, 1:] & m[:, :-1]).to(nll.dtype)
    return (nll * keep).sum(-1) / keep.sum(-1).clamp_min(1.0)


def pooled(out, inputs) -> torch.Tensor:
    """A sentence encoder's mean-pooled ``last_hidden_state`` ``(B, E)`` over real tokens."""
    h = out.last_hidden_state.float()
    m = inputs["attention_mask"].to(h.dtype)[..., None]
    return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


def answer_accuracy(start: int, answer: torch.Tensor) -> Callable:
    """Metric: share of the answer's tokens (at ``start..``) that the model predicts greedily given the
    true prefix (teacher-forced needle accuracy)."""
    n = len(answer)

    def metric(out, inputs):
        lg = _logits(out)[:, start - 1 : start - 1 + n]
        return (lg.argmax(-1) == answer.to(lg.device)[None]).double().mean(-1)

    return metric


__all__ = ["answer_accuracy", "draw_sets", "gated", "pooled", "span_loss", "target_loss", "text_loss", "verdict"]
