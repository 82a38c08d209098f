"""Cost formulas of the ``linear`` backend, by feature count.

With F features per position (elu+1 and relu: F = head_dim; FAVOR+: F = m random features),
E = d_v + 1 (the denominator rides as an extra column of v), per (batch, head), one layer:

* FAVOR+ projection: ``2 * (H Lq + Hkv Lk) * d * m`` (the matmuls ``x W^T``; elu/relu: 0),
* non-causal: state ``2 Lk F E`` per kv head, outputs ``2 Lq F E`` per query head,
* causal, chunk C: the chunk states ``2 Lk F E`` per kv head, and per query head the inherited
  state ``2 Lq F E`` plus the masked C x C block of its chunk ``2 Lq C (F + E)``.

Backward: twice the forward matmuls (each matmul has two gradient matmuls). Memory is O(n (F + C)):
features, chunk states, C x C blocks; no attention map is ever materialised.

    >>> from headlab import costs
    >>> shape = costs.AttentionShape(heads=8, q_len=16384, head_dim=64)
    >>> c = costs.estimate(shape, "linear")                   # elu + 1, the registered default
    >>> c.attention_weights_bytes, c.forward_flops
    (0, 2181038080)
    >>> dense = costs.estimate(shape, "sdpa").forward_flops
    >>> round(dense / c.forward_flops)                        # 4 n^2 d vs 4 n d (d + 1)
    252
    >>> favor = linear_cost(shape, feature_map="favor", num_features=256)    # any configuration
    >>> favor.forward_flops > 4 * c.forward_flops
    True
"""

from __future__ import annotations

from headlab.costs.model import AttentionCost, AttentionShape, CostedBackend, registered

__all__ = ["linear_cost", "linear_cost_for", "linear_flops"]


def linear_flops(
    shape: AttentionShape, num_features: int, *, favor: bool = False, chunk_size: int | None = None
) -> int:
    """Forward matmul FLOPs of one layer with ``num_features`` features per position (``chunk_size``:
    the causal chunk C, by default the registered ``linear`` backend's)."""
    if chunk_size is None:
        chunk_size = registered("linear").config.chunk_size  # type: ignore[attr-defined]  # a LinearBackend: costs imports no backend
    B, H, Hk, Lq, Lk, d = shape.batch, shape.heads, shape.kv_heads, shape.q_len, shape.kv_len, shape.head_dim
    Fn, E = num_features, shape.v_dim + 1
    flops = 2 * B * (H * Lq + Hk * Lk) * d * Fn if favor else 0
    if shape.causal:
        C = min(chunk_size, Lq)  # keys past the last query are never read (top-left causal)
        lpad = -(-Lq // C) * C
        flops += 2 * B * Hk * lpad * Fn * E  # chunk states (padded to whole chunks)
        flops += 2 * B * H * lpad * Fn * E  # inherited state, every query
        flops += 2 * B * H * lpad * C * (Fn + E)  # masked C x C block of each chunk
    else:
        flops += 2 * B * Hk * Lk * Fn * E + 2 * B * H * Lq * Fn * E
    return flops


def linear_cost(
    shape: AttentionShape, *, feature_map: str = "elu", num_features: int | None = None, chunk_size: int | None = None
) -> AttentionCost:
    """Cost of ``shape`` on a linear backend configured like ``LinearBackend(feature_map, ...)``
    (an instance of the registered ``linear`` backend's class, so the configuration is validated as there)."""
    options = {"num_features": num_features} | ({} if chunk_size is None else {"chunk_size": chunk_size})
    return linear_cost_for(shape, type(registered("linear"))(feature_map, **options))  # type: ignore[call-arg]  # as above: its class takes these


def linear_cost_for(shape: AttentionShape, backend: CostedBackend) -> AttentionCost:
    """Cost of ``shape`` on a configured instance (``from_string("favor:256")`` ...): reads its ``config``
    (feature map, features, chunk) and its memory formula. The formula the ``linear`` backend registers."""
    cfg = backend.config  # type: ignore[attr-defined]  # a LinearBackend, as above
    chunk_size = cfg.chunk_size
    favor = cfg.feature_map == "favor"
    Fn = cfg.features(shape.head_dim)
    L = shape.layers
    spec = shape.spec()
    fwd = linear_flops(shape, Fn, favor=favor, chunk_size=chunk_size)
    ws = backend.working_set_bytes(spec)
    s = max(shape.itemsize, 4)  # features and sums run in float32 at least
    B, H, Hk, Lq, Lk = shape.batch, shape.heads, shape.kv_heads, shape.q_len, shape.kv_len
    feat_bytes = B * (H * Lq + Hk * Lk) * Fn * s
    E = shape.v_dim + 1
    if shape.causal:
        C = min(chunk_size, Lq)
        n_chunks = -(-Lq // C)
        state_bytes = B * Hk * n_chunks * Fn * E * s
        block_bytes = B * H * n_chunks * C * C * s
    else:
        state_bytes, block_bytes = B * Hk * Fn * E * s, 0
    return AttentionCost(
        backend=backend.name,
        forward_flops=L * fwd,
        backward_flops=L * 2 * fwd,
        attention_weights_bytes=0,
        working_set_bytes=ws,
        # read q, k, v, write out; write and read the features; states and blocks once each way
        bytes_moved=L * (shape.io_bytes() + 2 * feat_bytes + 2 * state_bytes + 2 * block_bytes),
        saved_for_backward_bytes=L * (shape.io_bytes() + feat_bytes + state_bytes + block_bytes),
        notes=f"{cfg.label()}: {Fn} features per position; approximate (not softmax)",
    )
