"""Pruning heads: the curve (metric against share of heads removed) and the measured savings."""

from __future__ import annotations

from headlab.models.pruned import PrunedModel, prune_heads

__all__ = ["PrunedModel", "prune_heads"]
