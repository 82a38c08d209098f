"""The functional core: :func:`attention` and :func:`attention_weights`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from headlab.attention import backends as _backends
from headlab.attention.masks import MaskFn
from headlab.attention.spec import AttentionSpec, default_scale, validate

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
) -> torch.Tensor:
    """Multi-head scaled dot-product attention: ``softmax(q k^T * scale + M) v`` per head.

    Args:
        q: ``(batch, heads, q_len, head_dim)``.
        k: ``(batch, kv_heads, kv_len, head_dim)``; ``heads`` must be a multiple of ``kv_heads``
            (query head ``h`` reads kv head ``h // (heads // kv_heads)``).
        v: ``(batch, kv_heads, kv_len, v_dim)``.
        mask: boolean tensor broadcastable to ``(batch, heads, q_len, kv_len)``, True = may
            attend; or a mask function from :mod:`headlab.masks` (or any ``f(b, h, q_idx, kv_idx)``).
        causal: exactly torch's ``is_causal``: query ``i`` sees keys ``0..i`` (top-left aligned
            when ``q_len != kv_len``; see :func:`headlab.masks.causal_lower_right` for the other).
        scale: defaults to ``1/sqrt(head_dim)``.
        dropout_p: dropout on the attention probabilities (uses torch's RNG).
        backend: ``"auto"`` (the fastest exact backend that supports the call and fits in
            memory), a registered name (``headlab.backends()`` lists them) or a backend object.

    Returns:
        ``(batch, heads, q_len, v_dim)``. A query row that can see no key is all zeros.

    Example:
        >>> import torch, headlab
        >>> q = torch.randn(2, 8, 10, 16); k = v = torch.randn(2, 2, 12, 16)   # 8 query heads, 2 kv heads
        >>> out = headlab.attention(q, k, v, causal=True)
        >>> out.shape
        torch.Size([2, 8, 10, 16])
        >>> torch.allclose(out, headlab.attention(q, k, v, causal=True, backend="reference"), atol=1e-5)
        True
    """
    out, _ = attention_with_weights(q, k, v, mask=mask, causal=causal, scale=scale, dropout_p=dropout_p,
                        backend=backend, need_weights=False)
    return out


def attention_with_weights(q, k, v, *, mask, causal, scale, dropout_p, backend, need_weights):
    """:func:`attention` that can also return the weights: ``(out, weights (B, H, Lq, Lk) or None)``.

    Every argument is keyword-only and required (the layers above choose each one). ``need_weights=True``
    needs a backend that materialises the map (``"reference"``).
    """
    spec, norm_mask = validate(q, k, v, mask=mask, causal=causal, dropout_p=dropout_p, need_weights=need_weights)
    chosen = resolve_backend(backend, spec)  # auto has already checked memory
    if not (isinstance(backend, str) and backend == "auto"):
        chosen.check_memory(spec)
    scale = default_scale(spec.head_dim) if scale is None else float(scale)
    return chosen.forward(q, k, v, spec, mask=norm_mask, scale=scale)


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
    _, weights = attention_with_weights(q, k, v, mask=mask, causal=causal, scale=scale, dropout_p=0.0,
                            backend="reference", need_weights=True)
    return weights


def backends() -> list[dict]:
    """The registered backends with their capabilities, in ``auto``'s order of preference."""
    rows = []
    for name in _backends.names():
        b = _backends.get(name)
        rows.append({"name": name, "summary": b.summary, "priority": b.priority, **b.capabilities.as_dict()})
    return sorted(rows, key=lambda r: r["priority"])
