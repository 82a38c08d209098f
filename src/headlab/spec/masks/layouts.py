"""Sparse patterns defined by token sets and block layouts: Longformer's global tokens, BigBird,
any block layout, packed documents. Each has an EXACT closed-form block classifier.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import headlab.checks as checks
from headlab.errors import ConfigError, MaskError
from headlab.spec.masks.algebra import MaskFn, block_bounds, prefix_length
from headlab.spec.tile_states import EMPTY, FULL, PARTIAL

__all__ = ["bigbird", "block_layout", "documents", "global_tokens"]

_COUNT = "{name} must be >= 0 (a whole number of blocks), got {value!r}"


def _index_set(name: str, indices) -> torch.Tensor:
    t = torch.as_tensor(indices, dtype=torch.long).flatten()
    if t.numel() == 0:
        raise ConfigError(f"{name} needs at least one index, got an empty list")
    if bool((t < 0).any()):
        raise ConfigError(f"{name} indices must be >= 0, got {t.tolist()}")
    return torch.unique(t)


def global_tokens(indices: Sequence[int] | torch.Tensor) -> MaskFn:
    """Longformer's global tokens: they see every key and every query sees them.

    Use it with ``|``: ``sliding_window(256) | global_tokens([0])``. Indices at or beyond the
    sequence (``max(q_len, kv_len)``) are ignored, so one pattern serves several lengths; used on
    its own with no index inside the sequence it would silently be empty, and evaluating it
    raises :class:`~headlab.errors.MaskError` instead (inside a composition it adds nothing).

        >>> from headlab import masks
        >>> masks.global_tokens([0]).dense(q_len=4)[0, 0].int()
        tensor([[1, 1, 1, 1],
                [1, 0, 0, 0],
                [1, 0, 0, 0],
                [1, 0, 0, 0]], dtype=torch.int32)
    """
    idx = _index_set("global_tokens", indices)
    low = int(idx.min())

    def check(lq, lk):
        if low >= max(lq, lk):
            shown = idx.tolist() if idx.numel() <= 8 else idx[:8].tolist() + ["..."]
            raise MaskError(
                f"global_tokens {shown}: every index is outside the sequence (q_len={lq}, kv_len={lk}), "
                f"so no token would be global; indices must be < {max(lq, lk)}"
            )

    def flags(n, device):
        f = torch.zeros(n, dtype=torch.bool, device=device)
        inside = idx[idx < n].to(device)
        f[inside] = True
        return f

    def fn(b, h, q, kv, lq, lk):
        n = max(lq, lk, int(q.max()) + 1, int(kv.max()) + 1)
        f = flags(n, q.device)
        return f[q] | f[kv]

    def blocks(lq, lk, bq, bk, device, rows=None):
        cq, ck = prefix_length(flags(lq, device)), prefix_length(flags(lk, device))
        qs, qe = block_bounds(lq, bq, device, rows)
        ks, ke = block_bounds(lk, bk, device)
        nq, nk = cq[qe + 1] - cq[qs], ck[ke + 1] - ck[ks]  # global rows / columns per tile
        full = (nq == qe - qs + 1)[:, None] | (nk == ke - ks + 1)[None, :]
        any_ = (nq > 0)[:, None] | (nk > 0)[None, :]
        state = torch.where(full, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8)
        return state.view(1, 1, *state.shape)

    shown = idx.tolist() if idx.numel() <= 8 else idx[:8].tolist() + ["..."]
    m = MaskFn(fn, f"global_tokens({shown})", blocks=blocks, check=check)
    m.indices = idx.tolist()  # every index, sorted (the name shows at most 8; the cost model reads this)
    return m


def _layout_mask(get_layout, bq_: int, bk_: int, name: str, *, heads: int | None = None) -> MaskFn:
    """A mask constant on ``bq_ x bk_`` cells: ``layout[(h,) q // bq_, kv // bk_]``.

    ``get_layout(n_q_cells, n_kv_cells, device, c0=0, c1=None)`` returns bool
    ``(Hm, c1 - c0, n_kv_cells)``, the cell rows ``[c0, c1)`` (all of them by default).
    The block classifier is exact for any tile size: a tile is FULL when every cell it touches
    is on and EMPTY when none is (2-D prefix sums over the cell rows the tiles touch).
    """

    def cells(lq, lk, device, c0=0, c1=None):
        nq, nk = -(-lq // bq_), -(-lk // bk_)
        return get_layout(nq, nk, device, c0, nq if c1 is None else c1)

    def fn(b, h, q, kv, lq, lk):
        lay = cells(lq, lk, q.device)
        qc = torch.clamp(q, max=lq - 1) // bq_
        kc = torch.clamp(kv, max=lk - 1) // bk_
        if lay.shape[0] == 1:
            return lay[0][qc, kc]
        return lay[h, qc, kc]

    def blocks(lq, lk, bq, bk, device, rows=None):
        qs, qe = block_bounds(lq, bq, device, rows)
        ks, ke = block_bounds(lk, bk, device)
        first = int(qs[0]) // bq_  # the cell rows these tiles touch: [first, last]
        lay = cells(lq, lk, device, first, int(qe[-1]) // bq_ + 1).to(torch.long)  # (Hm, rows, nk)
        cs = torch.nn.functional.pad(lay.cumsum(1).cumsum(2), (1, 0, 1, 0))  # (Hm, rows + 1, nk + 1)
        r0, r1 = (qs // bq_ - first)[:, None], (qe // bq_ + 1 - first)[:, None]  # cell rows touched by each tile
        c0, c1 = (ks // bk_)[None, :], (ke // bk_ + 1)[None, :]
        on = cs[:, r1, c1] - cs[:, r0, c1] - cs[:, r1, c0] + cs[:, r0, c0]
        area = (r1 - r0) * (c1 - c0)
        state = torch.where(on == area, FULL, torch.where(on > 0, PARTIAL, EMPTY)).to(torch.int8)
        return state.unsqueeze(0)  # (1, Hm, n_qb, n_kb)

    m = MaskFn(fn, name, head_dependent=heads is not None and heads > 1, num_heads=heads, blocks=blocks)
    m.cell = (bq_, bk_)  # positions per cell (rows, columns): the cost model reads it
    m.cell_rows = cells  # cell_rows(q_len, kv_len, device, c0, c1) -> bool (Hm, c1 - c0, n_kv_cells)
    return m


def bigbird(
    block: int, window_blocks: int = 3, global_blocks: int = 2, random_blocks: int = 3, seed: int = 0
) -> MaskFn:
    """BigBird's block-sparse pattern (Zaheer et al. 2020, the ITC variant).

    The sequence is cut into blocks of ``block`` positions. Block row ``i`` sees: the
    ``window_blocks`` blocks centred on it (``|i - j| <= window_blocks // 2``), the first
    ``global_blocks`` blocks (and those blocks see everything), and ``random_blocks`` key
    blocks drawn without replacement from a generator seeded with ``seed`` and the block
    counts (so the same lengths give the same pattern on every call). Counts larger than the
    number of blocks are clamped to it; a block larger than the sequence makes one block.

    Args:
        block: positions per block, ``>= 1``.
        window_blocks: odd width of the block window, ``>= 1`` (BigBird uses 3).
        global_blocks, random_blocks: ``>= 0``.
        seed: seed of the random blocks.

        >>> from headlab import masks
        >>> m = masks.bigbird(2, window_blocks=1, global_blocks=1, random_blocks=0)
        >>> m.dense(q_len=6)[0, 0].int()
        tensor([[1, 1, 1, 1, 1, 1],
                [1, 1, 1, 1, 1, 1],
                [1, 1, 1, 1, 0, 0],
                [1, 1, 1, 1, 0, 0],
                [1, 1, 0, 0, 1, 1],
                [1, 1, 0, 0, 1, 1]], dtype=torch.int32)
    """
    bsz = checks.positive_int("bigbird block", block)
    w = checks.positive_int("bigbird window_blocks", window_blocks)
    if w % 2 == 0:
        raise ConfigError(f"bigbird window_blocks must be odd (the block and as many on each side), got {w}")
    g = checks.non_negative_int("bigbird global_blocks", global_blocks, message=_COUNT)
    r = checks.non_negative_int("bigbird random_blocks", random_blocks, message=_COUNT)
    seed = int(seed)
    cache: dict[tuple, torch.Tensor] = {}
    states: dict[tuple, dict[int, torch.Tensor]] = {}  # (nq, nk) -> {block row: generator state before it}

    def picks(nq, nk, c0, c1):
        """The random key blocks of block rows ``[c0, c1)``, ``(c1 - c0, rr)``: one generator, seeded
        per (seed, counts), draws a permutation per block row in order, so a later row needs every
        earlier draw; the state before every 256th row is kept, so rows can be asked for in pieces."""
        rr = min(r, nk)
        marks = states.setdefault((nq, nk), {})
        start = max((k for k in marks if k <= c0), default=0)
        gen = torch.Generator()
        if start in marks:
            gen.set_state(marks[start])
        else:
            gen.manual_seed(seed * 1_000_003 + nq * 1009 + nk)
        out = torch.empty((c1 - c0, rr), dtype=torch.long)
        for i in range(start, c1):
            if i % 256 == 0 and i not in marks and len(marks) < 4096:
                marks[i] = gen.get_state()
            row = torch.randperm(nk, generator=gen)[:rr]
            if i >= c0:
                out[i - c0] = row
        return out

    def layout_rows(nq, nk, c0, c1):
        i = torch.arange(c0, c1)[:, None]
        j = torch.arange(nk)[None, :]
        lay = (i - j).abs() <= w // 2
        lay = lay | (i < g) | (j < g)
        if min(r, nk):
            lay = lay.clone()
            lay[torch.arange(c1 - c0)[:, None], picks(nq, nk, c0, c1)] = True
        return lay.unsqueeze(0)

    def get_layout(nq, nk, device, c0=0, c1=None):
        c1 = nq if c1 is None else c1
        if (c0, c1) != (0, nq):  # some block rows: drawn again, not kept (the cost model streams them)
            return layout_rows(nq, nk, c0, c1).to(device)
        key = (nq, nk)
        lay = cache.get(key)
        if lay is None:
            cache[key] = lay = layout_rows(nq, nk, 0, nq)
        return lay.to(device)

    m = _layout_mask(get_layout, bsz, bsz, f"bigbird({bsz}, {w}, {g}, {r}, seed={seed})")
    m.bigbird = {"block": bsz, "window_blocks": w, "global_blocks": g, "random_blocks": r, "seed": seed}
    return m


def block_layout(layout: torch.Tensor, block: int | tuple[int, int]) -> MaskFn:
    """Any block-sparse pattern given as a boolean layout of ``block``-sized cells.

    Args:
        layout: bool ``(n_q_blocks, n_kv_blocks)``, or per head ``(heads, n_q_blocks, n_kv_blocks)``;
            ``layout[(h,) i, j]`` says whether query block ``i`` sees key block ``j``.
        block: cell size, an int or ``(block_q, block_k)``. When the mask is evaluated the
            layout must have exactly ``ceil(q_len / block_q)`` rows and ``ceil(kv_len / block_k)``
            columns (the last cell may be short), else :class:`~headlab.errors.MaskError`.

        >>> import torch
        >>> from headlab import masks
        >>> m = masks.block_layout(torch.tensor([[1, 0], [1, 1]], dtype=torch.bool), 2)
        >>> m.dense(q_len=3)[0, 0].int()
        tensor([[1, 1, 0],
                [1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
    """
    lay = torch.as_tensor(layout)
    if lay.dtype != torch.bool:
        if lay.dtype.is_floating_point or lay.dtype.is_complex or not bool(((lay == 0) | (lay == 1)).all()):
            raise MaskError(f"block_layout needs a boolean (or 0/1 integer) layout, got dtype {lay.dtype}")
        lay = lay.bool()
    if lay.dim() not in (2, 3) or lay.numel() == 0:
        raise MaskError(
            f"block_layout needs a (n_q_blocks, n_kv_blocks) or (heads, n_q_blocks, n_kv_blocks) layout, "
            f"got shape {tuple(lay.shape)}"
        )
    bq_, bk_ = (block, block) if not isinstance(block, tuple | list) else tuple(block)
    bq_ = checks.positive_int("block_layout block_q", bq_)
    bk_ = checks.positive_int("block_layout block_k", bk_)
    lay3 = lay if lay.dim() == 3 else lay.unsqueeze(0)  # (Hm, nq, nk)
    heads = lay3.shape[0] if lay.dim() == 3 else None

    def get_layout(nq, nk, device, c0=0, c1=None):
        if lay3.shape[1:] != (nq, nk):
            raise MaskError(
                f"block_layout has {lay3.shape[1]} x {lay3.shape[2]} blocks of {bq_} x {bk_} but the call needs "
                f"{nq} x {nk} (ceil(q_len / {bq_}) x ceil(kv_len / {bk_})); build the layout for this length"
            )
        return lay3[:, c0:c1].to(device)

    m = _layout_mask(get_layout, bq_, bk_, f"block_layout({tuple(lay.shape)}, {bq_}x{bk_})", heads=heads)
    m.layout = lay3  # bool (Hm, n_q_blocks, n_kv_blocks): the cost model counts tiles from it
    return m


def documents(lengths: Sequence[int] | torch.Tensor) -> MaskFn:
    """Packed sequences: a query sees only keys of its own document.

    Args:
        lengths: length of each document packed back to back, shape ``(n_docs,)``; each ``>= 1``.
            When evaluated, ``q_len`` and ``kv_len`` must both equal ``sum(lengths)``
            (else :class:`~headlab.errors.MaskError`). Combine with ``& causal()`` for a decoder.

        >>> from headlab import masks
        >>> (masks.documents([2, 3]) & masks.causal()).dense(q_len=5)[0, 0].int()
        tensor([[1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [0, 0, 1, 0, 0],
                [0, 0, 1, 1, 0],
                [0, 0, 1, 1, 1]], dtype=torch.int32)
    """
    lens = torch.as_tensor(lengths, dtype=torch.long).flatten()
    if lens.numel() == 0:
        raise ConfigError("documents(lengths) needs at least one document length, got an empty list")
    if bool((lens <= 0).any()):
        raise ConfigError(f"document lengths must be >= 1, got {lens.tolist()}")
    total = int(lens.sum())
    ends = torch.cumsum(lens, 0)  # exclusive end of each document

    def doc_ids(n, lq, lk, device):
        if lq != total or lk != total:
            raise MaskError(
                f"documents({lens.tolist() if lens.numel() <= 8 else '...'}) covers {total} positions but the call "
                f"has q_len={lq}, kv_len={lk}; the lengths must add up to the sequence length"
            )
        return torch.bucketize(torch.arange(n, device=device), ends.to(device), right=True)

    def fn(b, h, q, kv, lq, lk):
        n = max(lq, lk, int(q.max()) + 1, int(kv.max()) + 1)
        d = doc_ids(n, lq, lk, q.device)
        return d[q] == d[kv]

    def blocks(lq, lk, bq, bk, device, rows=None):
        d = doc_ids(max(lq, lk), lq, lk, device)
        qs, qe = block_bounds(lq, bq, device, rows)
        ks, ke = block_bounds(lk, bk, device)
        dq0, dq1, dk0, dk1 = d[qs][:, None], d[qe][:, None], d[ks][None, :], d[ke][None, :]
        any_ = (dq0 <= dk1) & (dk0 <= dq1)  # document ranges overlap (ids are sorted)
        full = (dq0 == dq1) & (dk0 == dk1) & (dq0 == dk0)
        state = torch.where(full, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8)
        return state.view(1, 1, *state.shape)

    shown = lens.tolist() if lens.numel() <= 8 else lens[:8].tolist() + ["..."]
    m = MaskFn(fn, f"documents({shown})", blocks=blocks)
    m.lengths = lens.tolist()  # every document length (the name shows at most 8; the cost model reads this)
    return m
