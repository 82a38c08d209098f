"""Gradient saliency at the word-embedding layer: ``gradient`` and ``grad_x_input``.

For one input with word embeddings ``e (L, E)`` and the scalar ``y`` (see
:mod:`~headlab.interpret.saliency.objective`):

    gradient_t     = || dy/de_t ||_2                      (>= 0)
    grad_x_input_t = sum_d (dy/de_t)_d * e_t,d            (signed; Jain and Wallace 2019 use |.|)

One forward and one backward on the backend in force (``sdpa``, or ``tiled`` with its own backward);
no attention map is materialised.
"""

from __future__ import annotations

import torch

from headlab.interpret.saliency.objective import Objective, embedding_module


def embeddings(objective: Objective, input_ids: torch.Tensor) -> torch.Tensor:
    """``(B, L, E)``: the word-embedding lookup's output, detached."""
    with torch.no_grad():
        return embedding_module(objective.model)(input_ids).detach()


def embedding_gradient(
    objective: Objective, input_ids: torch.Tensor, attention_mask: torch.Tensor, embeds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dy/de (B, L, E), y (B,))`` at ``embeds``: the rows' y are independent, so d(sum y)/de is per row."""
    e = embeds.detach().requires_grad_(True)
    with torch.enable_grad():
        y = objective.y(input_ids, attention_mask, e)
        (g,) = torch.autograd.grad(y.sum(), [e])
    return g.detach(), y.detach()


def gradient_scores(
    objective: Objective, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``{"gradient": (L,), "grad_x_input": (L,)}`` for a single input (batch of one), and ``"y"``."""
    e = embeddings(objective, input_ids)
    g, y = embedding_gradient(objective, input_ids, attention_mask, e)
    return {"gradient": g[0].norm(dim=-1), "grad_x_input": (g[0] * e[0]).sum(-1), "y": y[0]}
