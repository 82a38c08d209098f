"""Cost formula of the ``tiled`` backend: only the tiles the kernel visits are counted.

Per visited score entry (a query row x key column inside a non-empty tile) the kernel runs

* forward: ``s = [q*scale | -m] @ [k | 1]^T`` (``D + 1`` multiply-adds) and
  ``acc += P @ [v | 1]`` (``Dv + 1``): ``2 * (D + Dv + 2)`` FLOPs;
* backward (recomputation included): the score matmul again (``D + 1``), ``dV += P^T dO``
  (``Dv``), ``dP - D = [dO | -D] @ [v | 1]^T`` (``Dv + 1``), ``dQ += dS K`` and
  ``dK += dS^T Q`` (``D`` each): ``2 * (3D + 2Dv + 2)`` FLOPs, about 2.5x the forward.

The visited tiles are counted exactly (:mod:`headlab.costs.tiles`), tile for tile the states the
kernel walks, so causal attention counts about half the tiles and a sliding window far fewer;
``FlopCounterMode`` on the kernel measures exactly these numbers (tests/test_tiled.py). Tile sizes
and memory come from the backend instance (``backend.block_q``, ``backend.block_k``,
``backend.working_set_bytes``): ``estimate(shape, TiledBackend(block_q=64, block_k=64))`` costs that tiling.

    >>> from headlab import costs
    >>> full = costs.estimate(costs.AttentionShape(heads=8, q_len=4096, head_dim=64), "tiled")
    >>> causal = costs.estimate(costs.AttentionShape(heads=8, q_len=4096, head_dim=64, causal=True), "tiled")
    >>> full.attention_weights_bytes, round(causal.forward_flops / full.forward_flops, 3)
    (0, 0.531)
    >>> round(full.backward_flops / full.forward_flops, 2)
    2.48
"""

from __future__ import annotations

import torch

from headlab.costs.model import AttentionCost, AttentionShape, CostedBackend, registered
from headlab.costs.tiles import visited
from headlab.units import human_bytes

__all__ = ["tiled_cost", "tiled_flops", "visited_pairs"]


def _tiles(block_q: int | None, block_k: int | None) -> tuple[int, int]:
    """The given tile sizes, or those of the registered ``tiled`` backend."""
    b = registered("tiled") if block_q is None or block_k is None else None
    return (block_q or b.block_q, block_k or b.block_k)  # type: ignore[union-attr]  # b: a TiledBackend when a size is missing


def visited_pairs(shape: AttentionShape, block_q: int | None = None, block_k: int | None = None) -> int:
    """Score entries inside visited tiles, per (batch, head): edge tiles at their real size;
    under ``causal`` a tile's key range stops at its query block's end (the kernel cuts it there).
    Counted in closed form for the built-in patterns (:mod:`headlab.costs.tiles`). Tiles default
    to the registered ``tiled`` backend's.

    >>> visited_pairs(AttentionShape(q_len=1000, causal=True), 256, 512)
    625216
    """
    return visited.pairs(shape, *_tiles(block_q, block_k))


def tiled_flops(shape: AttentionShape, block_q: int | None = None, block_k: int | None = None) -> tuple[int, int]:
    """``(forward, backward)`` matmul FLOPs of one layer, as the kernel executes them."""
    block_q, block_k = _tiles(block_q, block_k)
    pairs = visited_pairs(shape, block_q, block_k) * shape.batch * shape.heads
    d, dv = shape.head_dim, shape.v_dim
    return 2 * pairs * (d + dv + 2), 2 * pairs * (3 * d + 2 * dv + 2)


def tiled_cost(shape: AttentionShape, backend: CostedBackend) -> AttentionCost:
    """The ``tiled`` backend (``backend``: a ``TiledBackend``, whose tiles and memory formula are read)."""
    block_q, block_k = backend.block_q, backend.block_k  # type: ignore[attr-defined]  # a TiledBackend: costs imports no backend
    L = shape.layers
    spec = shape.spec()
    plan = visited.plan_tiles(shape, block_q, block_k)  # the kernel's list of tile states
    pairs = visited_pairs(shape, block_q, block_k) * shape.batch * shape.heads
    d, dv = shape.head_dim, shape.v_dim
    fwd, bwd = 2 * pairs * (d + dv + 2), 2 * pairs * (3 * d + 2 * dv + 2)
    c = 8 if shape.dtype == torch.float64 else 4  # compute dtype
    n_qb = -(-shape.q_len // block_q)
    kv_bytes = shape.batch * shape.kv_heads * shape.kv_len * (shape.head_dim + shape.v_dim) * c
    # inputs and output once, K and V once per query block, and four passes over every visited
    # tile (the matmul writes S, exp_ reads and writes it, the value matmul reads it): the tiles
    # of a pure-PyTorch kernel are larger than a core's L2, so each pass is traffic.
    moved = shape.io_bytes() + (n_qb - 1) * kv_bytes + 4 * pairs * c
    saved = shape.io_bytes() + shape.batch * shape.heads * shape.q_len * (shape.v_dim + 1) * c  # q,k,v,out; lse
    return AttentionCost(
        backend=backend.name,
        forward_flops=L * fwd,
        backward_flops=L * bwd,
        attention_weights_bytes=0,
        working_set_bytes=backend.working_set_bytes(spec),  # spec.requires_grad is False: the forward's
        bytes_moved=L * moved,
        saved_for_backward_bytes=L * saved,
        notes=f"online softmax over {block_q}x{block_k} tiles; backward recomputes P"
        + (f"; the kernel's tile plan alone would take {human_bytes(plan)}" if plan > visited.MAP_BUDGET else ""),
    )
