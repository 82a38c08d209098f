"""What attention costs: FLOPs and bytes of every backend for a shape, predicted.

    >>> from headlab import costs
    >>> seed = costs.AttentionShape(heads=32, q_len=4096, layers=32, dtype="float16")
    >>> c = costs.estimate(seed, "reference")
    >>> c.attention_weights_bytes, c.attention_weights_bytes / 2**30      # the seed text's "32 GB"
    (34359738368, 32.0)
    >>> costs.estimate(seed, "sdpa").attention_weights_bytes
    0

Each backend's formula lives in a file of this package and registers itself with
:func:`register_cost`; a backend without one is an error, never a zero.
"""

from headlab.costs import dense, linear, sparse, tiled  # noqa: F401  (each registers its formulas)
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

__all__ = ["AttentionCost", "AttentionShape", "Hardware", "RingCost", "estimate", "estimate_all", "formulas",
           "parse_dtype", "register_cost", "ring_cost"]
