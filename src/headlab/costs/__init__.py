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

from importlib import import_module as _import_module

from headlab.costs import dense  # noqa: F401  (registers reference and sdpa)
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

__all__ = ["AttentionCost", "AttentionShape", "Hardware", "estimate", "estimate_all", "formulas",
           "parse_dtype", "register_cost"]

# Formulas contributed by later work register themselves here, one module each.
for _mod in ("tiled", "sparse", "linear"):
    try:
        _import_module(f"headlab.costs.{_mod}")
    except ModuleNotFoundError as _e:
        if _e.name != f"headlab.costs.{_mod}":
            raise
