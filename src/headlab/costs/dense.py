"""Cost formulas of the dense exact backends: ``reference`` and ``sdpa``.

FLOPs count the matmuls each backend executes (2 per multiply-add), the convention of
``torch.utils.flop_counter.FlopCounterMode``: forward ``2*B*H*Lq*Lk*(d + d_v)`` (= 4*B*H*Lq*Lk*d
when d_v = d). The reference backend computes every entry even when causal; torch's flash kernel
skips the tiles above the diagonal, so its causal cost counts visible pairs. Memory is each
backend's own formula (``backend.working_set_bytes``), read from the instance the formula is given.
"""

from __future__ import annotations

from headlab.costs.model import AttentionCost, AttentionShape, CostedBackend

__all__ = ["reference_cost", "sdpa_cost"]


def _matmul_flops(shape: AttentionShape, pairs: int) -> int:
    """Forward matmul FLOPs of one layer for ``pairs`` (query, key) pairs per head."""
    return 2 * shape.batch * shape.heads * pairs * (shape.head_dim + shape.v_dim)


def reference_cost(shape: AttentionShape, backend: CostedBackend) -> AttentionCost:
    """The ``reference`` backend: every score and probability materialised."""
    L = shape.layers
    spec = shape.spec()
    n2 = shape.batch * shape.heads * shape.q_len * shape.kv_len * shape.itemsize
    fwd = _matmul_flops(shape, shape.q_len * shape.kv_len)
    return AttentionCost(
        backend=backend.name,
        forward_flops=L * fwd,
        backward_flops=L * 2 * fwd,  # dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q
        attention_weights_bytes=L * n2,
        working_set_bytes=backend.working_set_bytes(spec),
        bytes_moved=L * (shape.io_bytes() + 4 * n2),  # write S, read S / write P, read P
        saved_for_backward_bytes=L * (n2 + shape.io_bytes()),  # P, q, k, v
        notes="materialises scores and probabilities",
    )


def sdpa_cost(shape: AttentionShape, backend: CostedBackend, block_q: int = 64) -> AttentionCost:
    """The ``sdpa`` backend: torch's flash kernel, or its math path where ``backend.materializes`` the map."""
    L = shape.layers
    spec = shape.spec()
    fwd = _matmul_flops(shape, shape.visible_pairs())
    s = shape.itemsize
    kv_bytes = shape.batch * shape.kv_heads * shape.kv_len * (shape.head_dim + shape.v_dim) * s
    n_qblocks = -(-shape.q_len // block_q)
    moved = shape.io_bytes() + (n_qblocks - 1) * kv_bytes  # K and V re-read once per query block
    lse = shape.batch * shape.heads * shape.q_len * 4
    mat = backend.materializes(spec)
    n2 = shape.batch * shape.heads * shape.q_len * shape.kv_len * s
    return AttentionCost(
        backend=backend.name,
        forward_flops=L * fwd,
        backward_flops=L * (fwd * 5 // 2),  # recomputes QK^T tile by tile: 2.5x forward
        attention_weights_bytes=L * n2 if mat else 0,
        working_set_bytes=backend.working_set_bytes(spec),
        bytes_moved=L * (moved + (4 * n2 if mat else 0)),
        saved_for_backward_bytes=L * (shape.io_bytes() + lse + (n2 if mat else 0)),
        notes="torch math path (materialises) because of dropout" if mat else "fused flash kernel",
    )
