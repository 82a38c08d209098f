"""Small readings of flow results for tables (the CLI and the studies render these, never compute).

>>> import torch
>>> ranked(torch.tensor([0.1, 0.6, 0.3]), ["a", "b", "c"], k=2)
[(1, 'b', 0.6000000238418579), (2, 'c', 0.30000001192092896)]
"""

from __future__ import annotations

import torch


def ranked(values: torch.Tensor, tokens: list[str] | None, k: int = 10) -> list[tuple[int, str, float]]:
    """The ``k`` largest entries of ``values (n,)`` as ``(position, token, value)``, largest first."""
    v = values.detach().flatten().float()
    order = torch.argsort(v, descending=True)[:k].tolist()
    return [(i, tokens[i] if tokens is not None else str(i), float(v[i])) for i in order]


def key_shares(summary) -> dict[str, list[float]]:
    """Mean over heads and queries of the share of attention weight and of attention norm that each
    chosen key receives (one value per key position of the :class:`~headlab.interpret.flow.norms.NormSummary`),
    and the same for the layer norm map (``"layer_norm"``)."""
    return {
        "weight": summary.key_weight.mean(dim=(0, 1)).tolist(),
        "norm": summary.key_norm_share.mean(dim=(0, 1)).tolist(),
        "layer_norm": summary.key_share.mean(0).tolist(),
    }


def category_shares(
    weights: torch.Tensor, norms: torch.Tensor, categories: dict[str, list[int]]
) -> dict[str, tuple[float, float]]:
    """Share of the weight map and of the norm map that falls on each category of keys.

    Args:
        weights: ``(H, n, n)`` attention weights; norms: ``(H, n, n)`` per-head norm maps.
        categories: name -> key positions.
    Returns:
        name -> (mean over heads and queries of sum_{j in cat} alpha_ij,
                 the same for ||alpha_ij f(x_j)|| / sum_j ||alpha_ij f(x_j)||).
    """
    wn = weights / weights.sum(-1, keepdim=True).clamp_min(1e-30)
    nn_ = norms / norms.sum(-1, keepdim=True).clamp_min(1e-30)
    out = {}
    for name, pos in categories.items():
        if not pos:
            out[name] = (0.0, 0.0)
            continue
        idx = torch.tensor(pos)
        out[name] = (float(wn[..., idx].sum(-1).mean()), float(nn_[..., idx].sum(-1).mean()))
    return out


__all__ = ["category_shares", "key_shares", "ranked"]
