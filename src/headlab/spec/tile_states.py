"""The three states of a ``(query tile, key tile)`` pair, shared by masks, block maps, kernels,
statistics, the cost model and ``headlab pattern``. Ordered so that AND is ``min`` and OR is
``max``; NOT is ``FULL - state``."""

EMPTY = 0  # no query of the tile sees any key of it: skipped
PARTIAL = 1  # some entries visible: the element-wise mask is applied
FULL = 2  # every entry visible: no element-wise work

__all__ = ["EMPTY", "FULL", "PARTIAL"]
