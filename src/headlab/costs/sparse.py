"""Cost formula of the ``"sparse"`` backend, read from the block map its kernel walks.

The kernel computes every non-empty ``BLOCK_Q x BLOCK_K`` tile of the mask's block map in full
(edge tiles padded to full size) and nothing else, so with ``T`` visited tiles summed over all
(batch, query head) pairs:

    forward  FLOPs = 2 * T * BLOCK_Q * BLOCK_K * (d + d_v)          (S = Q K^T, O = P V)
    backward FLOPs = 2 * T * BLOCK_Q * BLOCK_K * (3 d + 2 d_v)      (S again, dP, dV, dQ, dK)

which is what :class:`torch.utils.flop_counter.FlopCounterMode` counts on the kernel (tested).
The shape's ``mask`` field holds the mask function; ``causal`` is ANDed with it as the backend
does. Without either, every tile is visited (the ``full`` pattern; the backend hands such a call to
the dense tiled kernel). Tile sizes and memory come from the backend instance (``backend.block_q``,
``backend.block_k``, ``backend.working_set_bytes``).

    >>> from headlab import costs, masks
    >>> shape = costs.AttentionShape(heads=8, q_len=16384, head_dim=64, mask=masks.sliding_window(256))
    >>> c = costs.estimate(shape, "sparse")
    >>> dense = costs.estimate(costs.AttentionShape(heads=8, q_len=16384, head_dim=64), "sdpa")
    >>> round(c.forward_flops / dense.forward_flops, 4)      # about 5 of 128 key tiles per query tile
    0.0387
"""

from __future__ import annotations

from headlab.costs.model import AttentionCost, AttentionShape, CostedBackend, registered
from headlab.costs.tiles import visited
from headlab.units import human_bytes

__all__ = ["sparse_cost", "visited_tiles"]


def visited_tiles(shape: AttentionShape, block_q: int | None = None, block_k: int | None = None) -> int:
    """Tiles the sparse kernel computes for one layer, summed over batch and query heads (counted in
    closed form for the built-in patterns: see :mod:`headlab.costs.tiles`). Tiles default to the
    registered ``sparse`` backend's."""
    if block_q is None or block_k is None:
        b = registered("sparse")
        block_q, block_k = block_q or b.block_q, block_k or b.block_k  # type: ignore[attr-defined]  # a SparseBackend: costs imports no backend
    return visited.tiles(shape, block_q, block_k)


def sparse_cost(shape: AttentionShape, backend: CostedBackend) -> AttentionCost:
    """The ``sparse`` backend (``backend``: a ``SparseBackend``, whose tiles and memory formula are read)."""
    L = shape.layers
    bq, bk = backend.block_q, backend.block_k  # type: ignore[attr-defined]  # as above
    d, dv, s = shape.head_dim, shape.v_dim, shape.itemsize
    tiles = visited_tiles(shape, bq, bk)
    area = tiles * bq * bk
    fwd = 2 * area * (d + dv)
    bwd = 2 * area * (3 * d + 2 * dv)
    n_tiles = -(-shape.q_len // bq) * -(-shape.kv_len // bk) * shape.batch * shape.heads
    # K and V blocks are read once per visited tile; q, out once; the n x n map never exists
    moved = shape.io_bytes() + tiles * bk * (d + dv) * s
    lse = shape.batch * shape.heads * shape.q_len * 4
    note = f"{tiles:,} of {n_tiles:,} tiles of {bq}x{bk} visited ({tiles / max(1, n_tiles):.1%})"
    plan = visited.plan_tiles(shape, bq, bk)  # the kernel's block map: one int8 state per tile
    if plan > visited.MAP_BUDGET:
        note += f"; the kernel's block map alone would take {human_bytes(plan)}"
    if shape.mask is None and not shape.causal:
        note += "; without a mask or causal=True the backend runs the dense tiled kernel (figures for every tile)"
    return AttentionCost(
        backend=backend.name,
        forward_flops=L * fwd,
        backward_flops=L * bwd,
        attention_weights_bytes=0,
        working_set_bytes=backend.working_set_bytes(shape.spec()),
        bytes_moved=L * moved,
        saved_for_backward_bytes=L * (shape.io_bytes() + lse),
        notes=note,
    )
