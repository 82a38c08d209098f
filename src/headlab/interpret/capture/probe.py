"""What :func:`~headlab.models.sites.run_attention` and the W^O hooks report to during one capture."""

from __future__ import annotations

import dataclasses

import torch

from headlab.attention.stats import attention_stats
from headlab.models.sites import site_name


class Probe:
    """What :func:`run_attention` and the W^O hooks report to during one capture."""

    def __init__(self, wanted: dict[int, set[str]], grads: bool, stats_kwargs: dict, name=site_name) -> None:
        self.name = name  # (layer, kind) -> the site's name (the adapter's, with its stacks)
        self.wanted = wanted
        self.grads = grads
        self.stats_kwargs = stats_kwargs
        self.live: dict[str, torch.Tensor] = {}  # tensors in the graph (grads mode)
        self.data: dict[str, object] = {}
        self.call_args: dict[int, dict] = {}  # layer -> the mask, causal flag and scale its attention used

    def wants(self, layer: int, kind: str) -> bool:
        return kind in self.wanted.get(layer, ())

    def record(self, layer: int, kind: str, t: torch.Tensor) -> torch.Tensor:
        if self.wants(layer, kind):
            name = self.name(layer, kind)
            if self.grads:
                self.live[name] = t
            self.data[name] = t.detach()
        return t

    def record_stats(self, layer: int, q, k, v=None, *, mask, causal, scale, **score_kwargs):
        """Record ``blocks.{layer}.attn.stats``; with ``v``, the statistics' pass also computes the
        attention output (returned in the stats' ``output``, which the layer then uses instead of
        running attention a second time). Returns the :class:`AttentionStats`."""
        self.call_args[layer] = {"mask": mask, "causal": causal, "scale": scale, **score_kwargs}
        with torch.no_grad():
            # contiguous: HF hands q/k over as transposed views, which attention_stats may .view()
            st = attention_stats(
                q.detach().contiguous(),
                k.detach().contiguous(),
                None if v is None else v.detach().contiguous(),
                mask=mask,
                causal=causal,
                scale=scale,
                **score_kwargs,
                **self.stats_kwargs,
            )
        self.data[self.name(layer, "stats")] = st if v is None else dataclasses.replace(st, output=None)
        return st
