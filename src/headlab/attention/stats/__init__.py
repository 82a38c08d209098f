"""Per-head attention statistics without the n x n map: :func:`attention_stats`.

Looking inside attention usually means materialising every ``(batch, heads, q_len, kv_len)``
map (32 GiB for the seed's 32 layers x 32 heads at 4,096 tokens in float16). The numbers an
analyst reads off those maps are much smaller: one value per query, or per key, or a handful of
rows. :func:`attention_stats` computes them in passes over key tiles whose memory grows linearly
with the sequence length, and returns an :class:`AttentionStats`.

Statistics (``P`` is the attention map, ``i`` a query position, ``j`` a key position)::

    name            shape                          definition
    lse             (B, H, Lq)                     log sum_j exp(S_ij)        (S = q k^T * scale + mask)
    entropy         (B, H, Lq)                     -sum_j P_ij log P_ij       (natural log)
    max_weight      (B, H, Lq)                     max_j P_ij
    argmax          (B, H, Lq)  int64              the key j with the largest P_ij (the first on ties)
    mean_distance   (B, H, Lq)                     sum_j P_ij |i - j|
    key_mass        (B, H, Lq, len(key_positions)) P_ij at the chosen keys j = key_positions[m]
    received        (B, H, Lk)                     sum_i P_ij  (column sums: mass each key receives)
    rows            (B, H, len(query_rows), Lk)    exact rows P_i. for the chosen queries
    output          (B, H, Lq, Dv)                 P v, only when ``v`` is given

A query row that can see no key at all (fully masked) has ``lse = -inf``, ``entropy = 0``,
``max_weight = 0``, ``argmax = -1``, ``mean_distance = 0``, ``key_mass = 0``, a zero ``rows`` entry
and a zero output row, and adds nothing to ``received``; no statistic is ever NaN.

Two ways of computing them (``method``):

* ``"tiled"`` (default): one pass over the key tiles per block of query rows: the maximum,
  ``exp`` and the row sums of the online softmax (Milakov & Gimelshein 2018; Dao et al. 2022),
  with entropy, mean distance, argmax, the column sums and the output accumulated in the same pass
  (``H_i = log l_i - sum_j e_ij t_ij / l_i`` with ``t = S - m``; see :mod:`.fused`). Three kernels
  compute it: a compiled C++ one (:mod:`headlab.attention.backends.native`, built on first use with torch's own
  ``cpp_extension``; float32 on the CPU with no mask, ``causal``, a band of offsets such as a sliding
  window, or a key-padding mask: :func:`~headlab.attention.backends.native.declines` says), a
  PyTorch one (:mod:`.fused`, every mask and dtype), and, when a row of keys is too long for one
  unit or ``block_q`` / ``cache_bytes=0`` asks for it, two passes that recompute the score tiles
  (:mod:`.tiled`). Tiles a mask leaves empty are skipped (the call's tile states from
  :mod:`headlab.spec.visibility`). Supports every statistic.
* ``"sdpa"``: torch's fused CPU flash kernel delivers what an identity allows: ``lse`` from the kernel itself, ``entropy = lse - scale * q . (P K)`` with
  ``P K`` = attention with ``V := K``, ``mean_distance`` from attention with ``V := positions``
  (plus a second, causal call for the keys left of each query when the call is not causal),
  ``received`` = gradient of ``sum(out)`` with respect to ``V``, from the kernel's fused backward.
  ``max_weight`` and ``argmax`` have no such identity and raise
  :class:`~headlab.errors.BackendUnsupportedError`; ``stats=None`` then means every statistic
  the method supports. Masks (boolean or functions) are handed to the kernel as an additive
  float mask, which holds ``Lq x Lk`` values per (batch, head) the mask depends on: use
  ``"tiled"`` when the mask is large. ``causal=True`` alone needs no mask.

``key_mass`` and ``rows`` are computed the same way by both methods, from the final ``lse`` and
the scores of the chosen keys / queries only (``O(Lq * len(key_positions))`` and
``O(len(query_rows) * Lk)`` work).

Every statistic is computed in float32 at least (float16 / bfloat16 inputs are upcast) and
float64 inputs stay float64.

Example::

    >>> import torch, headlab
    >>> from headlab import masks
    >>> g = torch.Generator().manual_seed(0)
    >>> q = torch.randn(2, 4, 10, 8, generator=g); k = torch.randn(2, 2, 10, 8, generator=g)  # GQA
    >>> st = headlab.attention_stats(q, k, mask=masks.causal() & masks.padding([10, 7]),
    ...                              key_positions=[0], query_rows=[9])
    >>> st.entropy.shape, st.received.shape, st.key_mass.shape, st.rows.shape
    (torch.Size([2, 4, 10]), torch.Size([2, 4, 10]), torch.Size([2, 4, 10, 1]), torch.Size([2, 4, 1, 10]))
    >>> w = headlab.attention_weights(q, k, mask=masks.causal() & masks.padding([10, 7]))
    >>> torch.allclose(st.received, w.sum(-2), atol=1e-5), torch.allclose(st.rows, w[:, :, [9]], atol=1e-6)
    (True, True)
    >>> st.entropy[:, :, 0]          # the first query sees one key: entropy 0
    tensor([[0., 0., 0., 0.],
            [0., 0., 0., 0.]])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import headlab.checks as checks
from headlab.attention.backends import native
from headlab.attention.stats.exact import probs_at
from headlab.attention.stats.fused import fits, fused_stats
from headlab.attention.stats.sdpa import sdpa_stats
from headlab.attention.stats.stats_result import SDPA_STATS, STATS, AttentionStats, Method, index_tensor, wanted_stats
from headlab.attention.stats.tiled import DEFAULT_CACHE_BYTES, auto_block_q, tiled_stats
from headlab.errors import BackendUnsupportedError, ConfigError, MaskError
from headlab.spec.attention_spec import check_scale, validate
from headlab.spec.masks import MaskFn

__all__ = ["STATS", "SDPA_STATS", "AttentionStats", "attention_stats"]


def attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | MaskFn | Callable | None = None,
    causal: bool = False,
    scale: float | None = None,
    stats: Sequence[str] | str | None = None,
    key_positions: Sequence[int] | torch.Tensor | None = None,
    query_rows: Sequence[int] | torch.Tensor | None = None,
    block_k: int = 512,
    block_q: int | None = None,
    method: Method = "tiled",
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    score_mod: Callable | None = None,
) -> AttentionStats:
    """Per-head attention statistics in O(n) memory, never holding the ``(Lq, Lk)`` map.

    Args:
        q: ``(batch, heads, q_len, head_dim)``.
        k: ``(batch, kv_heads, kv_len, head_dim)``; query head ``h`` reads kv head
            ``h // (heads // kv_heads)``.
        v: optional ``(batch, kv_heads, kv_len, v_dim)``; when given the attention output is
            returned too (``AttentionStats.output``), computed in the same pass.
        mask: boolean tensor broadcastable to ``(batch, heads, q_len, kv_len)`` (True = may attend)
            or a mask function (:mod:`headlab.masks`), as in :func:`headlab.attention`.
        causal: torch's ``is_causal`` (top-left aligned).
        scale: defaults to ``1/sqrt(head_dim)``.
        stats: names from :data:`STATS` (a list or one name); ``None`` = every statistic the
            method supports, ``key_mass`` only when ``key_positions`` is given and ``rows`` only
            when ``query_rows`` is given.
        key_positions: key positions whose mass each query puts on them (the first token, a
            separator): ``(M,)`` shared by the batch, or ``(batch, M)`` per batch element (a
            separator moves with padding). Gives ``key_mass`` ``(B, H, Lq, M)``.
        query_rows: ``(R,)`` query positions whose full weight rows are returned (``rows``).
        block_k: key tile width.
        block_q: query rows per chunk of the two-pass kernel; given, it selects that kernel
            (default: the one-pass kernels, which choose their own blocks).
        method: ``"tiled"`` (every statistic) or ``"sdpa"`` (torch's fused kernel through the
            entropy / received-mass identities; no ``max_weight`` / ``argmax``). See the module
            docstring.
        cache_bytes: method ``"tiled"`` runs the one-pass kernels when two of their smallest units
            (16 query rows x every key) fit this many bytes; 0 selects the two-pass kernel.
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` applied to the scaled scores
            before the mask, as in :func:`headlab.attention` (soft-capping, ALiBi, a relative bias); the
            statistics are those of the modified map. Runs the two-pass kernel; method ``"tiled"`` only.

    Returns:
        :class:`AttentionStats`; fully masked query rows follow the rule in the module docstring.

    Raises:
        ShapeError, DTypeError, MaskError: as :func:`headlab.attention` does for bad tensors.
        ConfigError: unknown statistic or method, bad block sizes or positions.
        BackendUnsupportedError: a statistic the chosen method cannot compute.
    """
    if method not in ("tiled", "sdpa"):
        raise ConfigError(f"unknown method {method!r}; use 'tiled' (every statistic) or 'sdpa' (torch's fused kernel)")
    for name, val in (("block_k", block_k), ("block_q", block_q)):
        if val is not None:
            checks.positive_int(name, val)
    checks.non_negative_int("cache_bytes", cache_bytes)
    want = wanted_stats(stats, method, key_positions, query_rows)
    if isinstance(k, torch.Tensor) and k.dim() == 4:
        v_check = v if v is not None else k.new_empty(()).expand(*k.shape[:-1], 1)  # (B, Hkv, Lk, 1) view
    else:
        v_check = v if v is not None else k
    spec, norm_mask = validate(q, k, v_check, mask=mask, causal=causal)
    if spec.mask_kind == "additive":
        raise MaskError(
            "attention_stats takes a boolean mask (True = may attend) or a mask function, got an additive "
            "float mask; its -inf entries as a boolean mask: `mask = ~torch.isneginf(float_mask)` (the other "
            "values are not supported)"
        )
    scale = check_scale(scale, spec.head_dim)
    if score_mod is not None:
        from headlab.spec.score_mods import as_score_mod

        score_mod = as_score_mod(score_mod)
        if method != "tiled":
            raise BackendUnsupportedError(
                "method 'sdpa' cannot apply a score_mod (torch's fused kernel adds none); use method='tiled'"
            )
    ct = torch.float64 if spec.dtype == torch.float64 else torch.float32
    kp = (
        index_tensor("key_positions", key_positions, spec.kv_len, spec.batch, per_batch_ok=True)
        if key_positions is not None
        else None
    )
    qr = (
        index_tensor("query_rows", query_rows, spec.q_len, spec.batch, per_batch_ok=False)
        if query_rows is not None
        else None
    )
    kp = kp.to(spec.device) if kp is not None else None
    qr = qr.to(spec.device) if qr is not None else None

    with torch.no_grad():
        if method == "tiled":
            itemsize = 8 if ct == torch.float64 else 4
            one_pass = block_q is None and cache_bytes > 0 and score_mod is None
            if one_pass and native.declines(spec, norm_mask, ct) is None:
                res = native.statistics(q, k, v, norm_mask, scale, want, causal=spec.causal)
            elif one_pass and fits(spec, cache_bytes, itemsize):
                res = fused_stats(q, k, v, spec, norm_mask, scale, want, ct, block_k)
            else:
                bq = block_q or auto_block_q(spec, block_k, itemsize)
                res = tiled_stats(q, k, v, spec, norm_mask, scale, want, ct, bq, block_k, score_mod=score_mod)
            res["visible"] = ~torch.isneginf(res["lse"])
        else:
            res = sdpa_stats(q, k, v, spec, norm_mask, scale, want, ct)
        lse = res["lse"]
        if "key_mass" in want:
            res["key_mass"] = probs_at(q, k, spec, norm_mask, scale, ct, lse, None, kp, score_mod)  # (B, H, Lq, M)
        if "rows" in want:
            res["rows"] = probs_at(q, k, spec, norm_mask, scale, ct, lse, qr, None, score_mod)  # (B, H, R, Lk)
    kept = {name: res.get(name) for name in STATS if name in want}
    return AttentionStats(
        **kept, output=res.get("output"), key_positions=kp, query_rows=qr, visible=res["visible"], method=method
    )
