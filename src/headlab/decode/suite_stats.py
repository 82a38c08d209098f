"""Paired statistics for comparing two KV policies on the same tasks (:mod:`headlab.decode.suite`): a paired
bootstrap interval of a difference of means, McNemar's exact test and its paired interval for a difference of
accuracies, and perplexity on decoded tokens (teacher-forced over a held-out continuation after the prefill).

For two policies ``a`` and ``b`` scored 0/1 on the same ``n`` prompts, with ``n10`` prompts right under ``a`` only
and ``n01`` under ``b`` only, the difference of accuracies is ``(n10 - n01) / n``; its paired (Wald) interval is

    d +- z * sqrt(n10 + n01 - (n10 - n01)^2 / n) / n

and McNemar's exact p-value is the two-sided binomial probability of a split at least as uneven as ``n10 : n01``
among the ``n10 + n01`` discordant prompts, each side at probability 1/2.

    >>> from headlab.decode.suite_stats import mcnemar
    >>> r = mcnemar([1, 1, 1, 0, 1, 0, 1, 1], [1, 0, 1, 0, 1, 1, 0, 1])
    >>> r.n10, r.n01, r.diff, round(r.p_value, 4)
    (2, 1, 0.125, 1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from headlab.errors import ConfigError, InputError

__all__ = ["Paired", "McNemar", "decoded_nll", "mcnemar", "paired_bootstrap"]


def _pair(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = torch.as_tensor(a, dtype=torch.float64).flatten(), torch.as_tensor(b, dtype=torch.float64).flatten()
    if x.numel() != y.numel() or x.numel() == 0:
        raise InputError(f"paired scores need the same prompts under both policies: got {x.numel()} and {y.numel()}")
    return x, y


def _z(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise ConfigError(f"level={level}: give a confidence level in (0, 1), e.g. 0.95")
    return math.sqrt(2.0) * torch.erfinv(torch.tensor(level, dtype=torch.float64)).item()


@dataclass(frozen=True)
class Paired:
    """A paired bootstrap: the mean difference ``diff`` (a - b) and its percentile interval ``[low, high]``."""

    diff: float
    low: float
    high: float
    level: float
    n: int
    resamples: int


def paired_bootstrap(a, b, *, resamples: int = 10_000, level: float = 0.95, seed: int = 0) -> Paired:
    """The mean of ``a - b`` over prompts and its percentile interval from ``resamples`` bootstrap resamples of the
    prompts (both policies' scores resampled together, so the pairing is kept); reproducible from ``seed``."""
    x, y = _pair(a, b)
    _z(level)
    d = x - y
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, d.numel(), (resamples, d.numel()), generator=g)
    means = d[idx].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return Paired(float(d.mean()), lo, hi, level, d.numel(), resamples)


@dataclass(frozen=True)
class McNemar:
    """McNemar's comparison of two policies' 0/1 scores: discordant counts, the difference of accuracies with its
    paired interval, and the exact two-sided p-value."""

    n: int
    n10: int  # right under a, wrong under b
    n01: int  # wrong under a, right under b
    diff: float
    low: float
    high: float
    p_value: float
    level: float


def mcnemar(a, b, *, level: float = 0.95) -> McNemar:
    """McNemar's exact test and the paired Wald interval (module docstring) of ``a`` against ``b`` (0/1 per prompt)."""
    x, y = _pair(a, b)
    if not bool(((x == 0) | (x == 1)).all() & ((y == 0) | (y == 1)).all()):
        raise InputError("McNemar's test takes 0/1 scores per prompt (right or wrong); use paired_bootstrap otherwise")
    n = x.numel()
    n10, n01 = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
    d = (n10 - n01) / n
    se = math.sqrt(max(0.0, n10 + n01 - (n10 - n01) ** 2 / n)) / n
    z = _z(level)
    m = n10 + n01
    k = min(n10, n01)
    p = 1.0 if m == 0 else min(1.0, 2 * sum(math.comb(m, i) for i in range(k + 1)) / 2**m)
    return McNemar(n, n10, n01, d, d - z * se, d + z * se, p, level)


def decoded_nll(model, context, continuation, *, policy=None, question=None, kv_dtype=None) -> torch.Tensor:
    """The negative log-likelihood of each token of ``continuation`` (ids ``(1, m)``) after ``context`` (ids ``(1,
    n)``, the prefill a policy compresses; then ``question`` as one chunk when given), teacher-forced one token at a
    time through a :class:`~headlab.decode.HeadCache`, as decoding runs: ``(m,)`` float64 (perplexity is
    ``exp(mean)``). Unlike :func:`~headlab.decode.perplexity`, only the decoded tokens are scored: a quantized
    head is read from its codes and an evicting head sees only what it kept. ``kv_dtype``: the cache's storage
    dtype, as :func:`~headlab.decode.generate`'s."""
    from headlab.decode.generate import new_cache, setup_decoding

    adapter, _, policy = setup_decoding(model, policy)
    hf = adapter.model
    cont = torch.as_tensor(continuation).reshape(1, -1)
    if cont.shape[1] == 0:
        raise InputError("decoded_nll needs at least one continuation token")
    cap = getattr(hf.config, "final_logit_softcapping", None)
    head = hf.get_output_embeddings()
    out = []
    with torch.no_grad(), adapter.use_backend("auto"):
        cache = new_cache(adapter, policy, kv_dtype)
        last = hf.base_model(input_ids=torch.as_tensor(context).reshape(1, -1), cache=cache, use_cache=True)
        if question is not None:
            last = hf.base_model(input_ids=torch.as_tensor(question).reshape(1, -1), cache=cache, use_cache=True)
        h = last.last_hidden_state[0, -1:]
        for t in range(cont.shape[1]):
            z = head(h).float()
            if cap:
                z = torch.tanh(z / cap) * cap
            out.append(torch.nn.functional.cross_entropy(z, cont[0, t : t + 1], reduction="sum").double())
            if t + 1 < cont.shape[1]:
                h = hf.base_model(input_ids=cont[:, t : t + 1], cache=cache, use_cache=True).last_hidden_state[0, -1:]
    return torch.stack(out)
