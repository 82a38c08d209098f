"""Which (query, key) pairs are visible: the one place that combines mask AND causal.

A call's visibility is the AND of its normalised mask (a boolean tensor broadcastable to
``(B, H, Lq, Lk)``, an additive float tensor whose ``-inf`` entries are hidden, or a
:class:`~headlab.spec.masks.MaskFn`; padding is one of these) and ``causal`` (torch's
``is_causal``, top-left: query ``i`` sees keys ``j <= i``). Every backend, the statistics, the
cost model and the diagnostics read it from here:

* :func:`visible` -- bool visibility of chosen query rows x key columns (ranges or index tensors),
* :func:`additive_bias` -- the same as a float bias (0 / -inf, plus a float mask's values),
* :func:`tile_states` -- EMPTY / PARTIAL / FULL per tile, combined over batch and heads.

    >>> import torch
    >>> from headlab.spec.attention_spec import validate
    >>> q = torch.zeros(1, 1, 3, 4)
    >>> spec, m = validate(q, q, q, causal=True)
    >>> visible(spec, m)[0, 0].int()
    tensor([[1, 0, 0],
            [1, 1, 0],
            [1, 1, 1]], dtype=torch.int32)
    >>> tile_states(spec, m, 2, 2).tolist()
    [[1, 0], [2, 2]]
"""

from __future__ import annotations

import torch

from headlab.spec.blocks import block_map
from headlab.spec.masks import MaskFn
from headlab.spec.masks import causal as _causal
from headlab.spec.tile_states import EMPTY, FULL, PARTIAL

__all__ = [
    "additive_bias",
    "causal_tri",
    "eval_mask",
    "is_additive",
    "pairs",
    "tensor_states",
    "tile_states",
    "visible",
]

Index = tuple[int, int] | torch.Tensor | None  # a range [i0, i1), explicit positions, or everything

_CAUSAL = _causal()


def is_additive(mask) -> bool:
    """Whether a normalised mask is an additive float tensor (torch SDPA's float masks)."""
    return isinstance(mask, torch.Tensor) and mask.is_floating_point()


def _positions(idx: Index, n: int, device) -> torch.Tensor:
    if idx is None:
        return torch.arange(n, device=device)
    if isinstance(idx, tuple):
        return torch.arange(idx[0], idx[1], device=device)
    return idx.to(device)


def causal_tri(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``rows[:, None] >= cols`` as ``(1, 1, R, C)`` (or ``(B, 1, R, M)`` for per-batch columns)."""
    c = cols.view(cols.shape[0], 1, 1, -1) if cols.dim() == 2 else cols.view(1, 1, 1, -1)
    return rows.view(1, 1, -1, 1) >= c


def eval_mask(
    mask: MaskFn, batch: int, heads: int, q_len: int, kv_len: int, rows: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """A mask function at the given positions: ``(Bm, Hm, R, C)`` bool, or ``(B, Hm, R, M)`` when
    ``cols`` is a ``(B, M)`` tensor of per-batch positions."""
    per_batch = cols.dim() == 2
    bm = batch if (mask.batch_dependent or per_batch) else 1
    hm = heads if mask.head_dependent else 1
    dev = rows.device
    b = torch.arange(bm, device=dev).view(bm, 1, 1, 1)
    h = torch.arange(hm, device=dev).view(1, hm, 1, 1)
    q = rows.view(1, 1, -1, 1)
    kv = cols.view(bm, 1, 1, -1) if per_batch else cols.view(1, 1, 1, -1)
    out = mask.evaluate(b, h, q, kv, q_len, kv_len)
    return torch.broadcast_to(out, (bm, hm, q.shape[2], kv.shape[-1]))


def pairs(mask: MaskFn, b, h, q_idx, kv_idx, q_len: int, kv_len: int) -> torch.Tensor:
    """Visibility of explicit ``(b, h, q_idx, kv_idx)`` index tensors (broadcast together), as a
    gathering kernel asks for it: the mask function, and ``kv_idx < kv_len`` (key positions a
    padded tile adds past the sequence are hidden). Query positions past ``q_len`` are clamped to
    the last row (their outputs are discarded)."""
    m = mask.evaluate(b, h, q_idx.clamp(max=q_len - 1), kv_idx.clamp(max=kv_len - 1), q_len, kv_len)
    return m & (kv_idx < kv_len)


def _tensor_at(t: torch.Tensor, spec, rows: Index, cols: Index) -> torch.Tensor:
    """A 4-D tensor mask ``(Bm, Hm, Lq or 1, Lk or 1)`` at rows x cols (views for ranges)."""
    if isinstance(rows, tuple) and t.shape[2] != 1:
        t = t[:, :, rows[0] : rows[1]]
    elif isinstance(rows, torch.Tensor) and t.shape[2] != 1:
        t = t[:, :, rows.to(t.device)]
    if isinstance(cols, tuple) and t.shape[3] != 1:
        t = t[:, :, :, cols[0] : cols[1]]
    elif isinstance(cols, torch.Tensor) and cols.dim() == 2:  # per-batch keys (B, M): gather
        t = t.expand(spec.batch, t.shape[1], t.shape[2], spec.kv_len)
        t = torch.gather(t, 3, cols.view(spec.batch, 1, 1, -1).expand(spec.batch, t.shape[1], t.shape[2], -1))
    elif isinstance(cols, torch.Tensor) and t.shape[3] != 1:
        t = t[..., cols.to(t.device)]
    return t


def visible(spec, mask, rows: Index = None, cols: Index = None) -> torch.Tensor | None:
    """Visibility of query ``rows`` x key ``cols`` (a range ``(start, stop)``, a position tensor,
    or None for all; ``cols`` may be ``(B, M)`` per batch element): a bool tensor broadcastable
    to ``(B, H, R, C)``, or None when every pair is visible."""
    dev = spec.device
    vis = None
    if isinstance(mask, MaskFn):
        vis = eval_mask(
            mask,
            spec.batch,
            spec.heads,
            spec.q_len,
            spec.kv_len,
            _positions(rows, spec.q_len, dev),
            _positions(cols, spec.kv_len, dev),
        )
    elif isinstance(mask, torch.Tensor):
        t = _tensor_at(mask, spec, rows, cols)
        vis = ~torch.isneginf(t) if t.is_floating_point() else t
    if spec.causal:
        tri = causal_tri(_positions(rows, spec.q_len, dev), _positions(cols, spec.kv_len, dev))
        vis = tri if vis is None else vis & tri
    return vis


def additive_bias(spec, mask, rows: Index = None, cols: Index = None, *, dtype=torch.float32):
    """The visibility as an additive bias (0 where visible, -inf where hidden; a float mask adds
    its own values), broadcastable to ``(B, H, R, C)``, or None when nothing is added."""
    vis = None
    bias = None
    if is_additive(mask):
        bias = _tensor_at(mask, spec, rows, cols).to(dtype)
        if spec.causal:
            vis = causal_tri(_positions(rows, spec.q_len, spec.device), _positions(cols, spec.kv_len, spec.device))
    else:
        vis = visible(spec, mask, rows, cols)
    if vis is not None:
        hidden = torch.zeros((), dtype=dtype, device=spec.device).masked_fill(~vis, float("-inf"))
        bias = hidden if bias is None else bias + hidden
    return bias


def tensor_states(mask: torch.Tensor, q_len: int, kv_len: int, block_q: int, block_k: int) -> torch.Tensor:
    """EMPTY/PARTIAL/FULL per tile of a tensor mask ``(Bm, Hm, Lq or 1, Lk or 1)``:
    ``(Bm, Hm, n_q_blocks, n_kv_blocks)``. A float mask's tiles are EMPTY where every entry is
    ``-inf`` and PARTIAL otherwise (its values must be added everywhere)."""
    n_qb, n_kb = -(-q_len // block_q), -(-kv_len // block_k)
    additive = mask.is_floating_point()
    m = ~torch.isneginf(mask) if additive else mask
    sq = block_q if m.shape[2] != 1 else 1
    sk = block_k if m.shape[3] != 1 else 1
    nq = n_qb if m.shape[2] != 1 else 1
    nk = n_kb if m.shape[3] != 1 else 1
    pad = (0, nk * sk - m.shape[3], 0, nq * sq - m.shape[2])
    shape = (m.shape[0], m.shape[1], nq, sq, nk, sk)
    any_b = torch.nn.functional.pad(m, pad, value=False).reshape(shape).any(dim=5).any(dim=3)
    all_b = torch.nn.functional.pad(m, pad, value=True).reshape(shape).all(dim=5).all(dim=3)
    if additive:
        all_b = torch.zeros_like(all_b)
    st = torch.where(all_b, FULL, torch.where(any_b, PARTIAL, EMPTY)).to(torch.int8)
    return st.expand(m.shape[0], m.shape[1], n_qb, n_kb)


def tile_states(spec, mask, block_q: int, block_k: int, *, extra_partial: bool = False) -> torch.Tensor:
    """Tile states ``(n_q_blocks, n_kv_blocks)`` (int8 EMPTY / PARTIAL / FULL) of a call,
    combined over batch and heads: a tile is skipped only when it is empty for every
    (batch, head), and left unmasked only when it is full for every one. ``extra_partial``
    turns FULL into PARTIAL (a score modification has element-wise work on every tile)."""
    Lq, Lk = spec.q_len, spec.kv_len
    n_qb, n_kb = -(-Lq // block_q), -(-Lk // block_k)
    states = torch.full((n_qb, n_kb), FULL, dtype=torch.int8)
    parts = []
    if isinstance(mask, MaskFn):
        parts.append(block_map(mask, Lq, Lk, block_q, block_k, batch=spec.batch, heads=spec.heads).state.cpu())
    elif isinstance(mask, torch.Tensor):
        parts.append(tensor_states(mask.cpu(), Lq, Lk, block_q, block_k))
    if spec.causal:
        parts.append(block_map(_CAUSAL, Lq, Lk, block_q, block_k).state.cpu())
    for st in parts:
        st = st.reshape(-1, n_qb, n_kb)
        lo, hi = st.amin(0), st.amax(0)
        combined = torch.where(hi == EMPTY, EMPTY, torch.where(lo == FULL, FULL, PARTIAL)).to(torch.int8)
        states = torch.minimum(states, combined)  # AND of visibilities: EMPTY < PARTIAL < FULL
    if extra_partial:
        states = torch.minimum(states, torch.tensor(PARTIAL, dtype=torch.int8))
    return states
