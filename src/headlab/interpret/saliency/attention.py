"""Attention as an explanation, and editing it: the rows read from the classification position.

    attention_t = mean_h A^{(last layer)}_h[c, t]

where ``c`` is the classification position ([CLS] = 0 for an encoder, the last real token for a
decoder). :func:`attention_rows` returns the rows of every layer and head, ``(n_layers, H, L)``,
captured with :func:`headlab.capture` (which runs the captured layers on the reference path, the
only place the map exists; every other computation keeps the backend you chose).

:func:`edited_pattern` runs one layer from an edited attention map, ``fn(weights (B, H, Lq, Lk)) ->
weights``, through the adapter's edit hooks: the layer computes its map on the reference path, ``fn``
changes it, and the output is ``fn(weights) @ V``, so gradients flow into whatever ``fn`` closed over. The permutation test and
the adversarial search of Jain and Wallace 2019 (:mod:`~headlab.interpret.saliency.counterfactual`)
are built on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from headlab.interpret.capture import capture
from headlab.interpret.saliency.objective import Objective


def attention_rows(
    objective: Objective, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: str = "all"
) -> torch.Tensor | list[torch.Tensor]:
    """``(n_layers, H, L)`` (``layers="all"``) or ``(1, H, L)`` (``"last"``): attention from the classification position.

    A pruned model whose layers keep different numbers of heads gets a list of ``(H_l, L)`` instead
    (index it the same way: ``rows[layer][head]``)."""
    adapter = objective.loaded.adapter
    last = adapter.n_layers - 1
    sites = adapter.sites("pattern") if layers == "all" else adapter.site_name(last, "pattern")
    cache = capture(adapter, {"input_ids": input_ids, "attention_mask": attention_mask}, sites)
    c = objective.position(attention_mask)
    got = cache.layer("pattern")  # [(1, H, L, L)] per captured layer
    rows = [p[0, :, c, :] for p in got]  # (H_l, L) per layer
    return torch.stack(rows) if len({r.shape[0] for r in rows}) == 1 else rows  # (layers, H, L)


@contextlib.contextmanager
def edited_pattern(objective: Objective, layer: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Inside the block, attention layer ``layer`` runs from ``fn(its weights)``; the others keep their backend.

    Built on ``adapter.hooks({"blocks.{layer}.attn.pattern": ...})``, which runs that one layer on the
    reference path and recomputes its output from the edited map (so gradients reach what ``fn`` uses).
    """
    adapter = objective.loaded.adapter
    with adapter.hooks({adapter.site_name(layer, "pattern"): lambda w, site: fn(w)}):
        yield


def replace_row(position: int, new_row: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """An edit that puts ``new_row (B, H, Lk)`` in row ``position`` of every head's map."""

    def fn(w: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(w.shape[-2], device=w.device) == position  # (Lq,)
        return torch.where(rows.view(1, 1, -1, 1), new_row.to(w.dtype).unsqueeze(-2), w)

    return fn
