"""Integrated gradients (Sundararajan et al. 2017) at the word-embedding layer.

    IG_t = sum_d (e_t - b_t)_d * integral_0^1 (dy/de_t)_d (b + a (e - b)) da

along the straight line from the baseline ``b`` to the input's word embeddings ``e``, the integral
approximated with ``steps`` points: Gauss-Legendre by default (what captum's
``LayerIntegratedGradients`` uses by default, so the two agree to rounding), or the midpoint
Riemann rule (``method="riemann_middle"``). The steps run in batches (``batch_size`` interpolated
inputs per forward/backward).

Default baseline: special tokens ([CLS], [SEP], BOS) keep their embedding; every other token gets
the pad token's embedding (the unk token's where there is no pad). Completeness, the axiom IG is
built on, says ``sum_t IG_t = y(e) - y(b)``; :class:`IGResult` carries the gap
``|sum_t IG_t - (y(e) - y(b))| / |y(e) - y(b)|``, a measure of the quadrature error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import headlab.checks as checks
from headlab.errors import ConfigError
from headlab.interpret.saliency.gradients import embedding_gradient, embeddings
from headlab.interpret.saliency.objective import Objective, embedding_module

METHODS = ("gausslegendre", "riemann_middle")


@dataclass
class IGResult:
    """Integrated gradients of one input.

    Attributes:
        scores: ``(L,)`` IG_t per token (signed; special tokens are 0 under the default baseline).
        y: y at the input; y_baseline: y at the baseline.
        completeness_gap: ``|sum IG - (y - y_baseline)| / |y - y_baseline|`` (``inf`` if y == y_baseline).
        steps, method: the quadrature used.
    """

    scores: torch.Tensor
    y: float
    y_baseline: float
    completeness_gap: float
    steps: int
    method: str


MAX_STEPS = 10_000


def quadrature(steps: int, method: str = "gausslegendre") -> tuple[np.ndarray, np.ndarray]:
    """``(alphas, weights)`` on [0, 1] for ``steps`` points; the weights sum to 1."""
    checks.positive_int("ig_steps", steps, what=" (50 is the usual choice)")
    if steps > MAX_STEPS:  # leggauss builds a steps x steps matrix: 10**6 steps asked for terabytes
        raise ConfigError(
            f"ig_steps must be at most {MAX_STEPS:,} (Gauss-Legendre converges in tens of steps), got {steps:,}"
        )
    if method == "gausslegendre":
        x, w = np.polynomial.legendre.leggauss(steps)
        return 0.5 * (x + 1.0), 0.5 * w
    if method == "riemann_middle":
        return (np.arange(steps) + 0.5) / steps, np.full(steps, 1.0 / steps)
    raise ConfigError(f"unknown IG method {method!r}; known: {', '.join(METHODS)}")


def default_baseline(
    objective: Objective, input_ids: torch.Tensor, special: list[bool], baseline_token: int | None
) -> torch.Tensor:
    """``(1, L, E)``: the input's embeddings with every non-special token replaced by ``baseline_token``'s."""
    e = embeddings(objective, input_ids)
    b = e.clone()
    keep = torch.tensor(special, device=e.device)
    if baseline_token is None:
        b[0, ~keep] = 0.0
    else:
        with torch.no_grad():
            tok = embedding_module(objective.model)(torch.tensor([baseline_token], device=e.device))[0]
        b[0, ~keep] = tok
    return b


def integrated_gradients(
    objective: Objective,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    baseline: torch.Tensor,
    *,
    steps: int = 50,
    method: str = "gausslegendre",
    batch_size: int | None = None,
) -> IGResult:
    """IG of a single input (``input_ids (1, L)``) from ``baseline (1, L, E)``; see the module docstring.

    Args:
        batch_size: interpolated inputs per forward/backward (default: as many as keep about 4,096
            tokens per batch, at least 1).
    """
    alphas, weights = quadrature(steps, method)
    e = embeddings(objective, input_ids)  # (1, L, E)
    b = baseline.to(e.dtype)
    delta = e - b  # (1, L, E)
    L = input_ids.shape[1]
    bs = batch_size or max(1, min(steps, 4096 // max(L, 1)))
    total = torch.zeros_like(e[0], dtype=torch.float64)  # (L, E) sum_k w_k dy/de(x_k)
    for s in range(0, steps, bs):
        a = torch.tensor(alphas[s : s + bs], dtype=e.dtype, device=e.device)  # (K,)
        w = torch.tensor(weights[s : s + bs], dtype=torch.float64, device=e.device)
        K = len(a)
        x = b + a.view(K, 1, 1) * delta  # (K, L, E)
        g, _ = embedding_gradient(objective, input_ids.expand(K, L), attention_mask.expand(K, L), x)
        total += torch.einsum("k,kle->le", w, g.double())
    scores = (delta[0].double() * total).sum(-1)  # (L,)
    with torch.no_grad():
        ys = objective.y(input_ids.expand(2, L), attention_mask.expand(2, L), torch.cat([e, b]))
    y, y0 = float(ys[0]), float(ys[1])
    diff = y - y0
    gap = abs(float(scores.sum()) - diff) / abs(diff) if diff != 0 else float("inf")
    return IGResult(scores.to(e.dtype), y, y0, gap, steps, method)
