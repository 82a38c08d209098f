"""Counterfactual attention (Jain and Wallace 2019): would other weights have changed the output?

Both tests edit one thing: the row of the last layer's attention read from the classification
position c (every head), through :func:`~headlab.interpret.saliency.attention.edited_pattern`.

- :func:`permutation_test`: 100 random permutations of that row over the input's positions (one
  permutation per draw, the same for every head); the result is the median output change
  ``TVD(p(x), p_perm(x))`` and, beside it, the largest weight of the head-mean row. Jain and
  Wallace plot one against the other: a model whose output ignores permutation even when the
  attention is peaked does not depend on where it attends.
- :func:`adversarial_attention`: the largest Jensen-Shannon divergence (natural log, at most ln 2)
  from the original head-mean row among rows whose output stays within ``TVD <= 0.01`` of the
  original. Found by gradient search: each head's row is ``softmax(theta)``, started at the
  original (plus noise, several restarts in one batch) and moved by Adam to increase JSD with a
  hinge penalty on the TVD beyond the budget; the best row that satisfies the budget at any step
  is kept (the original itself, JSD 0, always does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from headlab.interpret.saliency.attention import edited_pattern, replace_row
from headlab.interpret.saliency.objective import Objective
from headlab.interpret.saliency.occlusion import tvd


def jsd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence along the last axis, natural log (0 .. ln 2)."""
    m = 0.5 * (p + q)

    def kl(a, b):
        return torch.where(a > 0, a * (torch.log(a.clamp_min(1e-30)) - torch.log(b.clamp_min(1e-30))), 0.0).sum(-1)

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def _change(objective: Objective, out, mask, p0, y0) -> torch.Tensor:
    y, p = objective.value(out, mask), objective.probs(out, mask)
    return (y - y0).abs() if p is None else tvd(p, p0[None])


@dataclass
class PermutationResult:
    median_tvd: float
    max_attention: float
    tvds: list[float]


def permutation_test(
    objective: Objective,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    row: torch.Tensor,
    *,
    n: int = 100,
    seed: int = 0,
    batch_size: int = 50,
) -> PermutationResult:
    """See the module docstring; ``row (H, L)`` is the last layer's attention from the classification position."""
    layer = objective.loaded.adapter.n_layers - 1
    c = objective.position(attention_mask)
    L = input_ids.shape[1]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        y0, p0 = objective.y_and_probs(input_ids, attention_mask)
        p0 = None if p0 is None else p0[0]
        out = []
        for s in range(0, n, batch_size):
            k = min(batch_size, n - s)
            perms = torch.stack([torch.randperm(L, generator=gen) for _ in range(k)]).to(row.device)  # (k, L)
            new = row[None].expand(k, -1, -1).gather(-1, perms[:, None, :].expand(-1, row.shape[0], -1))  # (k, H, L)
            ids, m = input_ids.expand(k, L), attention_mask.expand(k, L)
            with edited_pattern(objective, layer, replace_row(c, new)):
                o = objective.forward(ids, m)
            out.append(_change(objective, o, m, p0, y0[0]))
    tvds = torch.cat(out).float()
    return PermutationResult(float(np.median(tvds.numpy())), float(row.mean(0).max()), tvds.tolist())


@dataclass
class AdversarialResult:
    max_jsd: float  # the largest JSD to the original head-mean row found within the TVD budget
    tvd: float  # the output change of that row
    steps: int
    restarts: int
    row: torch.Tensor  # (H, L) the adversarial rows (every head) that reach max_jsd


def _gradient(objective: Objective, div: torch.Tensor, over: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """``d (sum(-div + over)) / d theta``. On a model sharded by tensor parallelism the edited map's heads live on
    their ranks, so each rank's backward through the model (``over``) reaches only its own heads' rows: those parts
    are added over the tensor-parallel group, while ``div`` (computed from ``theta`` alike on every rank) is not."""
    place = objective.loaded.adapter.placement
    if not place.sharded:
        (g,) = torch.autograd.grad((-div + over).sum(), [theta])
        return g
    (g_div,) = torch.autograd.grad((-div).sum(), [theta], retain_graph=True)
    (g_over,) = torch.autograd.grad(over.sum(), [theta], allow_unused=True)
    return g_div + place.sum_group(torch.zeros_like(theta) if g_over is None else g_over)


def adversarial_attention(
    objective: Objective,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    row: torch.Tensor,
    *,
    budget: float = 0.01,
    steps: int = 30,
    restarts: int = 4,
    lr: float = 0.5,
    penalty: float = 100.0,
    seed: int = 0,
) -> AdversarialResult:
    """See the module docstring; ``row (H, L)`` is the original last-layer row at the classification position."""
    layer = objective.loaded.adapter.n_layers - 1
    c = objective.position(attention_mask)
    H, L = row.shape
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        y0, p0 = objective.y_and_probs(input_ids, attention_mask)
        p0 = None if p0 is None else p0[0].detach()
    orig = row.mean(0).detach().double()  # (L,)
    noise = torch.randn(restarts, H, L, generator=gen).to(row.device, torch.float64)
    scale = torch.linspace(0.5, 3.0, restarts, dtype=torch.float64, device=row.device).view(-1, 1, 1)
    theta = (torch.log(row.detach().double().clamp_min(1e-12))[None] + scale * noise).requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=lr)
    ids, m = input_ids.expand(restarts, L), attention_mask.expand(restarts, L)
    best, best_tvd, best_row = 0.0, 0.0, row.detach().clone()
    for _ in range(steps + 1):
        new = torch.softmax(theta, -1)  # (R, H, L)
        with torch.enable_grad(), edited_pattern(objective, layer, replace_row(c, new)):
            out = objective.forward(ids, m)
            change = _change(objective, out, m, p0, y0[0]).double()  # (R,)
        div = jsd(new.mean(1), orig[None])  # (R,)
        d, ch = div.detach(), change.detach()
        ok = ch <= budget
        if bool(ok.any()):
            i = int(torch.where(ok, d, torch.full_like(d, -1.0)).argmax())
            if float(d[i]) > best:
                best, best_tvd, best_row = float(d[i]), float(ch[i]), new[i].detach().clone()
        opt.zero_grad()
        theta.grad = _gradient(objective, div, penalty * torch.relu(change - budget), theta)
        opt.step()
    return AdversarialResult(best, best_tvd, steps, restarts, best_row)
