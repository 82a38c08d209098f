"""Cost formula of the ``"sparse"`` backend, read from the block map its kernel walks.

The kernel computes every non-empty ``BLOCK_Q x BLOCK_K`` tile of the mask's block map in full
(edge tiles padded to full size) and nothing else, so with ``T`` visited tiles summed over all
(batch, query head) pairs:

    forward  FLOPs = 2 * T * BLOCK_Q * BLOCK_K * (d + d_v)          (S = Q K^T, O = P V)
    backward FLOPs = 2 * T * BLOCK_Q * BLOCK_K * (3 d + 2 d_v)      (S again, dP, dV, dQ, dK)

which is what :class:`torch.utils.flop_counter.FlopCounterMode` counts on the kernel (tested).
The shape's ``mask`` field holds the mask function; ``causal`` is ANDed with it as the backend
does. Without either, the backend refuses the call; the figures are then those of visiting every
tile (the ``full`` pattern).

    >>> from headlab import costs, masks
    >>> shape = costs.AttentionShape(heads=8, q_len=16384, head_dim=64, mask=masks.sliding_window(256))
    >>> c = costs.estimate(shape, "sparse")
    >>> dense = costs.estimate(costs.AttentionShape(heads=8, q_len=16384, head_dim=64), "sdpa")
    >>> round(c.forward_flops / dense.forward_flops, 4)      # about 5 of 128 key tiles per query tile
    0.0387
"""

from __future__ import annotations

from headlab.attention.backends import sparse as _sparse
from headlab.costs import visits
from headlab.costs.model import AttentionCost, AttentionShape, register_cost
from headlab.units import human_bytes


def visited_tiles(shape: AttentionShape) -> int:
    """Tiles the sparse kernel computes for one layer, summed over batch and query heads
    (counted in closed form for the built-in patterns: see :mod:`headlab.costs.visits`)."""
    return visits.tiles(shape, _sparse.BLOCK_Q, _sparse.BLOCK_K)


@register_cost("sparse")
def sparse_cost(shape: AttentionShape) -> AttentionCost:
    L = shape.layers
    bq, bk = _sparse.BLOCK_Q, _sparse.BLOCK_K
    d, dv, s = shape.head_dim, shape.v_dim, shape.itemsize
    tiles = visited_tiles(shape)
    area = tiles * bq * bk
    fwd = 2 * area * (d + dv)
    bwd = 2 * area * (3 * d + 2 * dv)
    n_tiles = -(-shape.q_len // bq) * -(-shape.kv_len // bk) * shape.batch * shape.heads
    # K and V blocks are read once per visited tile; q, out once; the n x n map never exists
    moved = shape.io_bytes() + tiles * bk * (d + dv) * s
    lse = shape.batch * shape.heads * shape.q_len * 4
    note = f"{tiles:,} of {n_tiles:,} tiles of {bq}x{bk} visited ({tiles / max(1, n_tiles):.1%})"
    plan = visits.plan_tiles(shape, bq, bk)  # the kernel's block map: one int8 state per tile
    if plan > visits.MAP_BUDGET:
        note += f"; the kernel's block map alone would take {human_bytes(plan)}"
    if shape.mask is None and not shape.causal:
        note += "; backend refuses calls without a mask or causal=True (figures for the full pattern)"
    return AttentionCost(
        backend="sparse",
        forward_flops=L * fwd,
        backward_flops=L * bwd,
        attention_weights_bytes=0,
        working_set_bytes=_sparse.working_set_bytes(shape.spec()),
        bytes_moved=L * moved,
        saved_for_backward_bytes=L * (shape.io_bytes() + lse),
        notes=note,
    )
