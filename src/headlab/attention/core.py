"""The functional core: :func:`attention`, :func:`attention_with_weights` and :func:`attention_weights`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from headlab.attention import backends as _backends
from headlab.spec.attention_spec import AttentionSpec, check_scale, validate
from headlab.spec.masks import MaskFn
from headlab.spec.score_mods import as_score_mod
from headlab.spec.visibility import visible

MaskLike = torch.Tensor | MaskFn | Callable | None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: MaskLike = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str | _backends.Backend = "auto",
    score_mod: Callable | None = None,
    return_lse: bool = False,
):
    """Multi-head scaled dot-product attention: ``softmax(score_mod(q k^T * scale) + M) v`` per head.

    Args:
        q: ``(batch, heads, q_len, head_dim)``.
        k: ``(batch, kv_heads, kv_len, head_dim)``; ``heads`` must be a multiple of ``kv_heads``
            (query head ``h`` reads kv head ``h // (heads // kv_heads)``).
        v: ``(batch, kv_heads, kv_len, v_dim)``.
        mask: boolean tensor broadcastable to ``(batch, heads, q_len, kv_len)``, True = may
            attend; an additive float tensor (torch SDPA's float masks: added to the scaled
            scores, ``-inf`` = hidden); or a mask function from :mod:`headlab.masks` (or any
            ``f(b, h, q_idx, kv_idx) -> bool``).
        causal: exactly torch's ``is_causal``: query ``i`` sees keys ``0..i`` (top-left aligned
            when ``q_len != kv_len``; see :func:`headlab.masks.causal_lower_right` for the other).
        scale: defaults to ``1/sqrt(head_dim)``; must be finite (else :class:`~headlab.errors.ConfigError`).
        dropout_p: dropout on the attention probabilities (uses torch's RNG), in ``[0, 1)``.
        backend: ``"auto"`` (the fastest exact backend that supports the call and fits in
            memory), a registered name (``headlab.backends()`` lists them) or a backend object.
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to
            the scaled scores before the mask (ready ones: ``headlab.masks.alibi``, ``softcap``,
            ``relative_bias``); served by ``reference``, ``tiled`` and ``sparse``.
        return_lse: also return the log-sum-exp ``(batch, heads, q_len)`` of the scores a row
            attends over (natural log, float32 at least; ``-inf`` for a row that sees no key).

    Returns:
        ``(batch, heads, q_len, v_dim)``, or ``(out, lse)`` with ``return_lse``.

    Non-finite values: a query row that can see no key is all zeros (zero gradients too); every
    other non-finite value reaches exactly the rows that read it: a NaN or inf in ``q_i`` makes
    row ``i`` non-finite, one in key or value row ``j`` makes every row that can see ``j`` NaN,
    and rows that cannot see ``j`` stay finite (on every backend). A non-finite ``scale`` is
    refused.

    Example:
        >>> import torch, headlab
        >>> q = torch.randn(2, 8, 10, 16); k = v = torch.randn(2, 2, 12, 16)   # 8 query heads, 2 kv heads
        >>> out = headlab.attention(q, k, v, causal=True)
        >>> out.shape
        torch.Size([2, 8, 10, 16])
        >>> torch.allclose(out, headlab.attention(q, k, v, causal=True, backend="reference"), atol=1e-5)
        True
        >>> out, lse = headlab.attention(q, k, v, causal=True, return_lse=True)
        >>> lse.shape
        torch.Size([2, 8, 10])
    """
    out, _, lse = _run(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        backend=backend,
        need_weights=False,
        need_lse=return_lse,
        score_mod=score_mod,
    )
    return (out, lse) if return_lse else out


def attention_with_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: MaskLike = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str | _backends.Backend = "auto",
    need_weights: bool = True,
    score_mod: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`attention` that can also return the weights: ``(out, weights (B, H, Lq, Lk) or None)``.

    With ``need_weights`` the backend must return weights (``reference`` does; ``auto`` picks it);
    the model adapters and :class:`~headlab.attention.module.MultiHeadAttention` call this."""
    out, weights, _ = _run(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        backend=backend,
        need_weights=need_weights,
        need_lse=False,
        score_mod=score_mod,
    )
    return out, weights


def _run(q, k, v, *, mask, causal, scale, dropout_p, backend, need_weights, need_lse, score_mod):
    spec, norm_mask = validate(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        dropout_p=dropout_p,
        need_weights=need_weights,
        need_lse=need_lse,
        score_mod=score_mod,
    )
    scale = check_scale(scale, spec.head_dim)
    chosen = resolve_backend(backend, spec)  # auto has already checked memory
    if not (isinstance(backend, str) and backend == "auto"):
        chosen.check_memory(spec)
    mod = as_score_mod(score_mod) if score_mod is not None else None
    bad_k, bad_v = _nonfinite_rows(k), _nonfinite_rows(v)
    if bad_k is not None or bad_v is not None:  # computed on finite stand-ins, then the readers are poisoned
        k = k if bad_k is None else k.masked_fill(bad_k.unsqueeze(-1), 0.0)
        v = v if bad_v is None else v.masked_fill(bad_v.unsqueeze(-1), 0.0)
    out, weights, lse = chosen.forward(q, k, v, spec, mask=norm_mask, scale=scale, score_mod=mod)
    if bad_k is not None or bad_v is not None:
        out, weights, lse = _poison_readers(spec, norm_mask, bad_k, bad_v, out, weights, lse)
    if need_lse and lse is not None:
        lse = lse.to(torch.promote_types(lse.dtype, torch.float32)).detach()
    return out, weights, lse


def _nonfinite_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``(B, Hkv, L)`` True where a key or value row holds a NaN or inf; None when all are finite."""
    if not t.is_floating_point() or bool(torch.isfinite(t.sum())):  # one reduction: a NaN or inf makes the sum so
        return None
    bad = ~torch.isfinite(t).all(-1)  # the sum overflowed or a row is bad: find the rows
    return bad if bool(bad.any()) else None


def _poison_readers(spec, mask, bad_k, bad_v, out, weights, lse):
    """The non-finite rule: a NaN or inf in key or value row ``j`` makes exactly the query rows that
    can see ``j`` NaN (their output; for a key also their weights and log-sum-exp), and no other.

    A backend computing ``P @ V`` would otherwise spread it to every row through ``0 * NaN`` for a
    hidden key, and a NaN key score would reach rows whose mask hides it through ``-inf + NaN``.
    The backends ran on zeros in place of the bad rows; only the bad key columns' visibility is
    evaluated here (``q_len x`` the few bad keys), never the whole map."""
    G = spec.group

    def readers(bad):  # (B, H, Lq): rows that see some bad key
        if bad is None:
            return None
        cols = torch.nonzero(bad.any(dim=(0, 1))).flatten()  # positions bad anywhere
        at = bad[:, :, cols].repeat_interleave(G, dim=1).unsqueeze(2)  # (B, H, 1, C)
        vis = visible(spec, mask, None, cols)  # broadcastable to (B, H, Lq, C), or None: all visible
        hit = at if vis is None else (vis & at)
        return hit.expand(spec.batch, spec.heads, spec.q_len, -1).any(-1)

    rk, rv = readers(bad_k), readers(bad_v)
    rows = rk if rv is None else (rv if rk is None else rk | rv)
    out = out.masked_fill(rows.unsqueeze(-1), float("nan"))
    if rk is not None:
        if weights is not None:
            weights = weights.masked_fill(rk.unsqueeze(-1), float("nan"))
        if lse is not None:
            lse = lse.masked_fill(rk, float("nan"))
    return out, weights, lse


def resolve_backend(backend: str | _backends.Backend, spec: AttentionSpec) -> _backends.Backend:
    """The backend that will serve ``spec``: ``"auto"`` chooses; an explicit one must support it."""
    if isinstance(backend, str) and backend == "auto":
        return _backends.choose(spec)
    chosen = _backends.get(backend)
    _backends.require(chosen, spec)
    return chosen


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    mask: MaskLike = None,
    causal: bool = False,
    scale: float | None = None,
    score_mod: Callable | None = None,
) -> torch.Tensor:
    """The materialised attention weights ``(batch, heads, q_len, kv_len)``.

    Same conventions as :func:`attention`. Rows that see no key are zeros. Refused with
    :class:`~headlab.errors.MemoryBudgetError` before allocating when the map will not fit.

        >>> import torch, headlab
        >>> w = headlab.attention_weights(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), causal=True)
        >>> torch.allclose(w.sum(-1), torch.ones(1, 2, 3))
        True
        >>> bool((w[0, 0].triu(1) == 0).all())
        True
    """
    v = k.new_zeros(k.shape[:-1] + (1,))  # (B, Hkv, Lk, 1): the output is discarded
    _, weights = attention_with_weights(
        q, k, v, mask=mask, causal=causal, scale=scale, backend="reference", need_weights=True, score_mod=score_mod
    )
    assert weights is not None  # need_weights=True
    return weights


def backends() -> list[dict]:
    """The registered backends with their capabilities, in ``auto``'s order of preference."""
    rows = []
    for name in _backends.names():
        b = _backends.get(name)
        rows.append({"name": name, "summary": b.summary, "priority": b.priority, **b.capabilities.as_dict()})
    return sorted(rows, key=lambda r: r["priority"])
