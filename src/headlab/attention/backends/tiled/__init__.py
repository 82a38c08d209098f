"""``"tiled"``: exact attention over key tiles with an online softmax (FlashAttention on the CPU).

Nothing ``q_len x kv_len`` is ever held: the forward pass walks the key tiles of each query
block, keeping per query row a running maximum ``m``, normaliser ``l`` and accumulator ``acc``
(Dao et al. 2022; :mod:`.textbook` is the algorithm in 30 lines); it saves the output and the
log-sum-exp ``lse = m + log l``. The backward pass recomputes each tile's probabilities
``P = exp(S - lse)`` from ``q``, ``k`` and ``lse`` and accumulates ``dq``, ``dk``, ``dv`` tile by
tile. Memory is linear in the sequence.

Rooms: :mod:`.plan` (tiles, states, element-wise work, layout), :mod:`.forward`,
:mod:`.backward`, :mod:`.memory` (the working-set formula), :mod:`.textbook`.

Which tiles are visited comes from :func:`headlab.spec.visibility.tile_states`::

    causal, q_len=6, kv_len=6, 2x2 tiles          a tile is
        k0-1 k2-3 k4-5                              EMPTY   (.) skipped: no matmul at all
    q0-1   P    .    .                              PARTIAL (P) computed, element-wise mask applied
    q2-3   F    P    .                              FULL    (F) computed, no mask work
    q4-5   F    F    P

Speed (docs/tiled.md has the measurements): the running maximum is taken exactly on the first
key tile of each query block and then kept ("stale"): later tiles compute
``exp(scale * q k^T - m)`` with ``-m`` folded into the matmul (an extra query column against a
row of ones in K^T), and the row sums come out of the value matmul through a column of ones
appended to V. That leaves one element-wise pass (``exp_``) per tile. Because the softmax is
shift invariant this is exact as long as nothing overflows; a query block whose result is not
finite (a later tile 88 logits above the first one) or has an empty row is recomputed with the
textbook per-tile rescaling, which is also the path of additive float masks and score
modifications. Under ``causal`` a key tile stops at its query block's end, and only the columns
past the block's first query are masked. The forward runs its work units (a query block x a
few heads) in a pool of ``torch.get_num_threads()`` Python threads with single-threaded torch
ops inside (torch releases the GIL in its ops), each reusing one score-tile buffer; torch's
thread count is set to 1 for the duration of the call and restored after (other threads of the
process that run torch ops meanwhile run them single-threaded too). The backward runs serially
with torch's own intra-op threads.

Float16/bfloat16 inputs are computed in float32 (accumulation in float32); float64 stays
float64. A query row that sees no key returns zeros and gets zero gradients; NaN propagates.

    >>> import torch
    >>> from headlab.attention.backends.tiled import tiled_attention
    >>> q = torch.randn(1, 4, 37, 16); k = v = torch.randn(1, 2, 50, 16)      # GQA: 4 heads, 2 kv heads
    >>> out, lse = tiled_attention(q, k, v, causal=True, block_q=16, block_k=16, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([1, 4, 37, 16]), torch.Size([1, 4, 37]))
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    >>> torch.allclose(out, ref, atol=1e-5)
    True
"""

from __future__ import annotations

import torch

from headlab.attention.backends.base import Backend, Capabilities, register
from headlab.attention.backends.tiled.backward import TiledAttention
from headlab.attention.backends.tiled.memory import working_set_bytes
from headlab.attention.backends.tiled.plan import BLOCK_K, BLOCK_Q, check_blocks, make_plan, tile_states
from headlab.attention.backends.tiled.textbook import flash_attention_textbook
from headlab.costs.tiled import tiled_cost
from headlab.spec.attention_spec import AttentionSpec, check_scale, validate
from headlab.spec.memory_guard import check_fits

__all__ = [
    "BLOCK_K",
    "BLOCK_Q",
    "TiledBackend",
    "flash_attention_textbook",
    "tile_states",
    "tiled_attention",
    "working_set_bytes",
]


def _run(q, k, v, spec: AttentionSpec, mask, scale: float, dropout_p: float, seed, block_q, block_k, score_mod=None):
    """``out (B, H, Lq, Dv)`` in q's dtype and ``lse (B, H, Lq)`` in the compute dtype (natural
    log, ``-inf`` on rows that see no key)."""
    plan = make_plan(spec, mask, scale, dropout_p, seed, block_q, block_k, score_mod)
    params = score_mod.trainable() if hasattr(score_mod, "trainable") else ()
    out, lse = TiledAttention.apply(q, k, v, plan, *params)  # (B, H, Lq, Dv), (B, H, Lq)
    return out, lse.masked_fill(torch.isinf(lse) & (lse > 0), float("-inf"))


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask=None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    return_lse: bool = False,
    score_mod=None,
):
    """Exact attention in O(n) memory; same conventions as :func:`headlab.attention`.

    Args:
        q: ``(batch, heads, q_len, head_dim)``.
        k: ``(batch, kv_heads, kv_len, head_dim)``; ``heads % kv_heads == 0`` (GQA, no copies).
        v: ``(batch, kv_heads, kv_len, v_dim)``.
        mask: bool tensor broadcastable to ``(batch, heads, q_len, kv_len)`` (True = may attend),
            an additive float tensor, or a mask function; tiles it hides entirely are skipped,
            tiles it shows entirely are computed without element-wise masking.
        causal: torch's ``is_causal`` (top-left); tiles above the diagonal are skipped.
        scale: defaults to ``1/sqrt(head_dim)``.
        dropout_p: dropout on the probabilities. The keep-mask of each tile is drawn from a
            generator seeded by ``(seed, tile)``, so backward regenerates it exactly.
        seed: dropout seed; default drawn from torch's RNG (``torch.manual_seed`` reproduces it).
        block_q, block_k: query positions and key positions per tile.
        return_lse: also return the log-sum-exp ``(batch, heads, q_len)`` in float32 (float64
            for float64 inputs); ``-inf`` on rows that see no key.
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``.

    Returns:
        ``out (batch, heads, q_len, v_dim)`` in the input dtype, and ``lse`` when asked.

        >>> import torch
        >>> q = k = v = torch.randn(1, 2, 5, 8)
        >>> out = tiled_attention(q, k, v, mask=torch.zeros(5, 5, dtype=torch.bool))
        >>> float(out.abs().max())          # no visible key anywhere: zeros, not NaN
        0.0
    """
    spec, norm = validate(q, k, v, mask=mask, causal=causal, dropout_p=dropout_p, score_mod=score_mod)
    scale = check_scale(scale, spec.head_dim)
    out, lse = _run(q, k, v, spec, norm, scale, dropout_p, seed, block_q, block_k, score_mod)
    return (out, lse) if return_lse else out


@register
class TiledBackend(Backend):
    name = "tiled"
    summary = "exact online-softmax attention over key tiles, O(n) memory, custom backward (FlashAttention on CPU)"
    capabilities = Capabilities(
        returns_weights=False, materializes=False, additive_mask=True, score_mod=True, returns_lse=True
    )
    priority = 10  # auto prefers torch's fused kernel whenever it serves the call
    alternative = "sdpa"
    cost = staticmethod(tiled_cost)  # reads block_q, block_k and working_set_bytes of the instance

    def __init__(self, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> None:
        """The registry holds one with the default tile; build another for other tile shapes,
        e.g. ``headlab.attention(q, k, v, backend=TiledBackend(64, 128))``."""
        check_blocks(block_q, block_k)
        self.block_q, self.block_k = block_q, block_k

    def working_set_bytes(self, spec: AttentionSpec) -> int:
        return working_set_bytes(spec, self.block_q, self.block_k)

    def check_memory(self, spec: AttentionSpec) -> None:
        check_fits(
            working_set_bytes(spec, self.block_q, self.block_k),
            what=f"backend 'tiled' at {spec.q_len}x{spec.kv_len}",
            device=spec.device,
            alternative=None,
        )

    def forward(self, q, k, v, spec, *, mask, scale, score_mod=None):
        out, lse = _run(q, k, v, spec, mask, scale, spec.dropout_p, None, self.block_q, self.block_k, score_mod)
        return out, None, lse
