"""``"sparse"``: exact block-sparse attention that visits only the tiles a mask leaves non-empty.

The mask (a :mod:`headlab.masks` function, ANDed with ``causal`` when asked) is compiled to a
:class:`~headlab.spec.blocks.BlockMap` of ``BLOCK_Q x BLOCK_K`` tiles. Only non-empty tiles
are computed; FULL tiles skip the element-wise mask, PARTIAL tiles apply it (the mask is
evaluated once per partial tile and cached with the plan). Compute and memory are proportional
to the visited tiles, forward and backward; nothing ``n x n`` is held or saved.

How the CPU kernel batches the work: a *work item* is one query block of one (batch, head
group). Items that visit the same number ``k`` of key blocks form a group; for a chunk of a
group the visited key blocks are gathered into ``(items, k * BLOCK_K, d)`` and the whole chunk
runs as three batched matmuls with a direct softmax over the gathered keys (all keys of a row
are in the chunk, so no online rescaling is needed). Chunks are sized to bound memory.

    item rows   (G * BLOCK_Q query rows when the mask is the same for every head: the G query
                 heads that share a kv head are stacked, so K/V are never copied per query head)
    S = Q_item (K_gathered)^T * scale      (items, rows, k * BLOCK_K)
    S[not visible] = -inf                  only when the group has partial tiles
    P = exp(S - rowmax);  O = P V / rowsum;  lse = rowmax + log(rowsum)

The forward splits the groups into *units* of about ``UNIT_ELEMS`` scores (a few head copies x
items) and runs them in a pool of ``torch.get_num_threads()`` Python threads, each running
single-threaded torch ops with its own reused scratch buffers (torch's thread count is restored
afterwards; under a dispatch mode such as FlopCounterMode the units run serially in the calling
thread). Scores are in natural-log units throughout (the backward recomputes ``P = exp(S - lse)``
from the same scaled query, so the probabilities match the forward's), partial tiles get an additive 0/-inf bias (much faster than a bool
``masked_fill_``), and when an item's key blocks are consecutive (sliding windows) the keys and
values are read as strided views instead of gathered copies.

Backward (a custom autograd function) recomputes ``P = exp(S - lse)`` per chunk from q, k and
the saved log-sum-exp, and scatters ``dK = dS^T Q``, ``dV = P^T dO`` into the key blocks.
A query row that sees no key returns zeros and gets zero gradients.

Exact with respect to the masked softmax (tested against the reference backend under the
FlashAttention error rule). ``auto`` never picks it over ``sdpa``: use ``backend="sparse"``.

    >>> import torch, headlab
    >>> from headlab import masks
    >>> q, k, v = (torch.randn(1, 4, 300, 16) for _ in range(3))
    >>> out = headlab.attention(q, k, v, mask=masks.sliding_window(32), backend="sparse")
    >>> ref = headlab.attention(q, k, v, mask=masks.sliding_window(32), backend="reference")
    >>> torch.allclose(out, ref, atol=1e-5)
    True
"""

from __future__ import annotations

import torch

from headlab.attention.backends.base import Backend, Capabilities, register
from headlab.attention.backends.sparse.kernel import SparseAttention
from headlab.attention.backends.sparse.plan import (
    BLOCK_K,
    BLOCK_Q,
    SparsePlan,
    block_map,
    effective_mask,
    plan_for,
    visited_tiles,
)
from headlab.attention.backends.sparse.tiles import CHUNK_ELEMENTS
from headlab.costs.sparse import sparse_cost
from headlab.errors import BackendUnsupportedError
from headlab.spec.attention_spec import AttentionSpec, check_scale, validate
from headlab.spec.masks import MaskFn
from headlab.spec.memory_guard import check_fits


def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskFn, *, causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """Block-sparse exact attention; same conventions as :func:`headlab.attention`.

    Args:
        q: ``(batch, heads, q_len, head_dim)``; k: ``(batch, kv_heads, kv_len, head_dim)``;
            v: ``(batch, kv_heads, kv_len, v_dim)``.
        mask: a :mod:`headlab.masks` function (``None`` allowed when ``causal``).

    Returns ``(batch, heads, q_len, v_dim)`` in q's dtype (float16/bfloat16 compute in float32).
    """
    spec, norm = validate(q, k, v, mask=mask, causal=causal)
    backend = SparseBackend()
    ok, why = backend.supports(spec)
    if not ok:
        raise BackendUnsupportedError(f"sparse_attention cannot serve this call: {why}")
    out, _, _ = backend.forward(q, k, v, spec, mask=norm, scale=check_scale(scale, spec.head_dim))
    return out


def tensor_mask(t: torch.Tensor) -> MaskFn:
    """A boolean tensor mask ``(Bm, Hm, Lq or 1, Lk or 1)`` (True = may attend) as a mask function
    reading it, so that the block map skips the tiles it leaves empty. Positions past its last row
    or column (a kernel's padded tiles) read the last one; the kernel hides padded keys itself."""
    Bm, Hm, Q, K = t.shape

    def read(b, h, q_idx, kv_idx, q_len, kv_len):
        def at(idx, n):
            idx = torch.as_tensor(idx, device=t.device)
            return idx.clamp(0, n - 1) if n > 1 else torch.zeros_like(idx)

        return t[at(b, Bm), at(h, Hm), at(q_idx, Q), at(kv_idx, K)]

    return MaskFn(
        read,
        f"tensor_mask{tuple(t.shape)}",
        batch_dependent=Bm > 1,
        head_dependent=Hm > 1,
        batch_size=Bm if Bm > 1 else None,
        num_heads=Hm if Hm > 1 else None,
    )


def working_set_bytes(spec: AttentionSpec) -> int:
    """Peak extra bytes of one forward call: a few chunk buffers plus O(n d) flat copies."""
    acc = 8 if spec.dtype == torch.float64 else 4
    chunk = 3 * CHUNK_ELEMENTS * acc  # scores/probabilities, gathered K and V (bounded by the chunk)
    flat = (
        spec.batch
        * (
            spec.heads * (spec.q_len + BLOCK_Q) * (spec.head_dim + spec.v_dim + 1)
            + spec.kv_heads * (spec.kv_len + BLOCK_K) * (spec.head_dim + spec.v_dim)
        )
        * acc
    )
    return chunk + flat


@register
class SparseBackend(Backend):
    name = "sparse"
    summary = "block-sparse exact attention: visits only non-empty tiles of the mask's block map"
    capabilities = Capabilities(
        bool_mask=True,
        additive_mask=False,
        dropout=False,
        returns_weights=False,
        exact=True,
        materializes=False,
        score_mod=True,
    )
    priority = 50  # exact, but auto prefers sdpa for dense calls: ask for it by name
    alternative = "sdpa"
    cost = staticmethod(sparse_cost)  # reads block_q, block_k and working_set_bytes
    block_q, block_k = BLOCK_Q, BLOCK_K  # the tiles of the kernel's block map

    def working_set_bytes(self, spec: AttentionSpec) -> int:
        return working_set_bytes(spec)

    def supports(self, spec: AttentionSpec) -> tuple[bool, str]:
        if spec.mask_kind == "additive":
            return False, (
                "additive float tensor masks are not supported (their values would be added on every "
                "tile); use backend='tiled', or a score_mod for the bias with a mask function"
            )
        ok, why = super().supports(spec)
        if not ok:
            return ok, why
        return True, ""  # a call without a mask has every tile to visit: the dense tiled kernel serves it

    def check_memory(self, spec: AttentionSpec) -> None:
        check_fits(
            working_set_bytes(spec),
            what=f"backend 'sparse' at {spec.q_len}x{spec.kv_len}",
            device=spec.device,
            alternative="sdpa",
        )

    def forward(self, q, k, v, spec, *, mask, scale, score_mod=None):
        if mask is None and not spec.causal:
            # no mask: no tile is empty, so there is nothing to skip; the dense tiled kernel computes the same
            # exact attention (sparse's FULL-tile path missed the flash rule on tests/cases.py's decode case)
            from headlab.attention.backends.tiled import TiledBackend

            return TiledBackend().forward(q, k, v, spec, mask=None, scale=scale, score_mod=score_mod)
        if isinstance(mask, torch.Tensor):  # a bool tensor: its block map skips the tiles it leaves empty
            mask = tensor_mask(mask)
        eff = effective_mask(mask, spec.causal)
        plan = plan_for(eff, spec.batch, spec.heads, spec.kv_heads, spec.q_len, spec.kv_len)
        dtype = q.dtype
        if dtype in (torch.float16, torch.bfloat16):  # accumulate in float32
            q, k, v = q.float(), k.float(), v.float()
        params = score_mod.trainable() if hasattr(score_mod, "trainable") else ()
        out, lse = SparseAttention.apply(
            q.contiguous(), k.contiguous(), v.contiguous(), plan, eff, scale, score_mod, spec, *params
        )
        return out.to(dtype), None, lse.masked_fill(torch.isposinf(lse), float("-inf"))


__all__ = [
    "BLOCK_K",
    "BLOCK_Q",
    "SparseBackend",
    "SparsePlan",
    "block_map",
    "effective_mask",
    "plan_for",
    "sparse_attention",
    "tensor_mask",
    "visited_tiles",
    "working_set_bytes",
]
