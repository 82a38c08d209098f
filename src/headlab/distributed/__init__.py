"""Attention past one machine, on PyTorch's own distributed engine (``torch.distributed``).

- :func:`ring_attention`: exact attention over a sequence sharded across ranks (context
  parallelism, Liu et al. 2023), forward and backward, GQA, causal and mask functions of global
  positions, contiguous or load-balanced ``"zigzag"`` shards.
- :func:`ring_attention_stats`: per-head statistics (lse, entropy, max/argmax, mean distance, the
  mass each key receives) of the same computation, never holding a map.
- :func:`shard`, :func:`unshard`, :func:`chunks`: cut a full tensor into a rank's shard and back.
- :mod:`headlab.distributed.data`: data-parallel analysis under ``torchrun`` (split a dataset across
  ranks, add up the per-example sums).

Launch with ``torchrun`` (gloo on CPU, NCCL on GPUs); see docs/distributed.md.
"""

from headlab.distributed.layout import LAYOUTS, chunks, positions, shard, unshard
from headlab.distributed.ring import ring_attention
from headlab.distributed.stats import RING_STATS, ring_attention_stats

__all__ = ["LAYOUTS", "RING_STATS", "chunks", "positions", "ring_attention", "ring_attention_stats", "shard", "unshard"]
