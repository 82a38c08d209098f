"""What attention costs: FLOPs and bytes of every backend for a shape, predicted.

    >>> from headlab import costs
    >>> seed = costs.AttentionShape(heads=32, q_len=4096, layers=32, dtype="float16")
    >>> c = costs.estimate(seed, "reference")
    >>> c.attention_weights_bytes, c.attention_weights_bytes / 2**30      # the seed text's "32 GB"
    (34359738368, 32.0)
    >>> costs.estimate(seed, "sdpa").attention_weights_bytes
    0

The package, top down:

* :mod:`~headlab.costs.model`: the shape model (:class:`AttentionShape`), a cost, hardware, and the
  table of formulas, which the backend registry fills;
* one formula per backend family, ``formula(shape, backend) -> AttentionCost``: :mod:`~headlab.costs.dense`
  (reference, sdpa), :mod:`~headlab.costs.tiled`, :mod:`~headlab.costs.sparse`, :mod:`~headlab.costs.linear`,
  and :mod:`~headlab.costs.ring` for ring attention over ranks;
* :mod:`headlab.costs.tiles`: the exact tile counting the tiled and sparse formulas read.

A backend class declares its formula (``cost = staticmethod(costs.tiled.tiled_cost)``) and the registry
refuses a backend without one; :func:`estimate` then calls it with the backend instance, whose
configuration (tile sizes, feature map) and memory formula it reads. A backend without a formula is an
error, never a zero. This package imports only :mod:`headlab.spec` (the spec, masks, tile
states, block maps), never an engine: measuring real calls is :mod:`headlab.attention.measure`.
"""

from headlab.costs import dense, linear, sparse, tiled  # noqa: F401  (costs.sparse.visited_tiles ...)
from headlab.costs.kv import full_cache_bytes, kv_cache_bytes, policy_cache_bytes
from headlab.costs.model import (
    AttentionCost,
    AttentionShape,
    Hardware,
    estimate,
    estimate_all,
    formulas,
    parse_dtype,
    register_cost,
)
from headlab.costs.ring import RingCost, ring_cost

__all__ = [
    "full_cache_bytes",
    "kv_cache_bytes",
    "policy_cache_bytes",
    "AttentionCost",
    "AttentionShape",
    "Hardware",
    "RingCost",
    "estimate",
    "estimate_all",
    "formulas",
    "parse_dtype",
    "register_cost",
    "ring_cost",
]
