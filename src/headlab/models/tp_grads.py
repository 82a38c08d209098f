"""Gradients at head sites of a model sharded by tensor parallelism, each rank for the heads it holds.

Attribution patching needs ``d m / d a`` at every head's ``z``, ``q``, ``k``, ``v`` or pattern. On a sharded
model each rank holds ``H / world`` query heads (:mod:`headlab.models.tensor_parallel`), so :func:`site_grads`
puts an identity :class:`~headlab.models.tensor_parallel.by_heads` edit at every site asked for: it is handed
this rank's heads (in the autograd graph, with their global indices) and keeps them; one forward and one
backward, every rank of the tensor-parallel group alike, give each rank the gradients of its own heads. Nothing
is gathered: a study makes its per-head numbers on the owners (zeros elsewhere) and adds them over the group
(attribution patching, :mod:`headlab.interpret.patching.attribution`).

Why the backward is the whole gradient on every rank, with transformers' plan as it is (no hook of headlab's
adds a collective to it):

- the row-parallel W^O ends in an all-reduce (a ``Partial`` output made ``Replicate``); the loss is computed
  alike on every rank from that replicated output, so the all-reduce's backward is the identity and each
  rank's heads receive ``d m / d (attention output)`` whole;
- the column-parallel q/k/v (and the MLP's first projections) take the replicated residual stream; each rank's
  backward gives a ``Partial`` input gradient, which DTensor all-reduces on the way back to the replicated
  input, so the residual stream's gradient (and every earlier layer's) is whole on every rank;
- headlab's own W^O hooks (:func:`~headlab.models.tensor_parallel.gate_hook`) reshape and gate local tensors
  only; an edited ``head_out`` is rebuilt with an in-place all-reduce whose backward autograd takes as the
  identity, which is again the all-reduce's true backward for a loss computed alike on every rank.

``tests/test_tensor_parallel_atlas.py`` checks each point against one process: the residual stream's gradient
at every layer, and attribution patching of every head site.

Unsharded, :func:`site_grads` gives every head (``heads`` is ``range(H)``), the same numbers as
``headlab.capture(..., grads=True)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from headlab.errors import ConfigError
from headlab.models.tensor_parallel import by_heads


@dataclass
class SiteGrads:
    """One forward and backward: this rank's heads at each site, ``d scalar / d`` them, and the outputs."""

    values: dict[str, torch.Tensor]  # site -> (B, heads here, L, ...) detached
    grads: dict[str, torch.Tensor]  # site -> d scalar / d values, same shape
    heads: dict[str, range]  # site -> global indices of axis 1 (query heads, or kv heads at k and v)
    scalar: float  # the value of scalar(outputs)
    outputs: object  # the model's outputs (detached where autograd left them)


def site_grads(adapter, inputs, sites: Mapping[str, str], scalar: Callable, *, backend=None) -> SiteGrads:
    """``d scalar(outputs) / d site`` for this rank's heads at every site of ``sites`` ``{name: kind}`` (kinds
    with a head axis: ``z``, ``q``, ``k``, ``v``, ``pattern``), from one forward and one backward of ``inputs``
    (a dict of tensors or an ``input_ids`` tensor). Every rank of a sharded model must call it alike."""
    kept: dict[str, tuple[torch.Tensor, range]] = {}

    def keep(t: torch.Tensor, site: str, heads: range) -> torch.Tensor:
        kept[site] = (t, heads)
        return t

    edits = {name: by_heads(keep) for name in sites}
    with adapter.use_backend(backend or adapter.backend or "auto"), adapter.hooks(edits), torch.enable_grad():
        outputs = adapter.forward(inputs)
        value = scalar(outputs)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ConfigError(f"scalar(outputs) must return a one-element tensor, got {type(value).__name__}")
        missing = [n for n in sites if n not in kept]
        if missing:
            raise ConfigError(
                f"the forward never reached the site(s) {', '.join(missing)}; give sites this model has "
                "(adapter.sites(kind))"
            )
        names = list(sites)
        got = torch.autograd.grad(value.reshape(()), [kept[n][0] for n in names], allow_unused=True)
    return SiteGrads(
        values={n: kept[n][0].detach() for n in names},
        grads={n: torch.zeros_like(kept[n][0]) if g is None else g.detach() for n, g in zip(names, got)},
        heads={n: kept[n][1] for n in names},
        scalar=float(value.detach()),
        outputs=outputs,
    )


__all__ = ["SiteGrads", "site_grads"]
