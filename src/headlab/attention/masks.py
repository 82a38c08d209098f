"""Mask functions: *which* scores count, as data.

A mask function answers, for a batch index ``b``, head ``h``, query position ``q_idx`` and
key position ``kv_idx``, whether the query may attend to the key (True = may attend, the
convention of :func:`torch.nn.functional.scaled_dot_product_attention` and FlexAttention).
Indices arrive as broadcastable integer tensors, so a mask is written with tensor
operations and evaluated for a whole tile at once::

    >>> import headlab
    >>> from headlab import masks
    >>> m = masks.causal() & masks.padding([3, 4])
    >>> m.dense(batch=2, heads=1, q_len=4, kv_len=4)[0, 0].int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 0]], dtype=torch.int32)

Masks compose with ``&``, ``|`` and ``~``. Any plain function ``f(b, h, q_idx, kv_idx)``
written with tensor operations can be passed where a mask is expected; :func:`as_mask`
wraps it. A mask that needs the sequence lengths (``causal_lower_right``) receives them
when it is evaluated.

``causal`` vs ``causal_lower_right`` when ``q_len != kv_len`` (here q_len=2, kv_len=4)::

    causal()  (top-left, torch is_causal)     causal_lower_right()  (query i is key i + kv_len - q_len)
        k0 k1 k2 k3                               k0 k1 k2 k3
    q0   1  0  0  0                           q0   1  1  1  0
    q1   1  1  0  0                           q1   1  1  1  1

The lower-right form is what decoding with a KV cache needs: the last query sees every key.

Every mask can be materialised densely (:meth:`MaskFn.dense`) for tests and pictures, and
compiled to a :class:`~headlab.attention.blocks.BlockMap` (:meth:`MaskFn.block_map`) that
tells a tiled kernel which tiles are empty, partial or full.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from headlab.errors import ConfigError, MaskError

if TYPE_CHECKING:
    from headlab.attention.blocks import BlockMap

# fn(b, h, q_idx, kv_idx, q_len, kv_len) -> bool tensor broadcastable to the index shapes
_Inner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]
# blocks(q_len, kv_len, block_q, block_k, device) -> int8 (Bm, Hm, n_qb, n_kb) of EMPTY/PARTIAL/FULL
_BlockHint = Callable[[int, int, int, int, torch.device], torch.Tensor]

__all__ = [
    "MaskFn",
    "as_mask",
    "causal",
    "causal_lower_right",
    "padding",
    "full",
]


class MaskFn:
    """A composable mask function ``f(b, h, q_idx, kv_idx) -> bool``.

    Args:
        fn: ``fn(b, h, q_idx, kv_idx, q_len, kv_len) -> bool tensor``; the index tensors are
            broadcastable (for example ``b: (B,1,1,1)``, ``h: (1,H,1,1)``, ``q_idx: (1,1,Lq,1)``,
            ``kv_idx: (1,1,1,Lk)``).
        name: shown in ``repr`` and in error messages.
        batch_dependent / head_dependent: whether the answer changes with ``b`` / ``h``; when
            False, dense and block evaluation is done once and broadcast.
        batch_size / num_heads: the sizes the mask was built for, when it was built for fixed
            sizes (a padding mask knows its batch size); checked against the call.
        blocks: optional exact-or-conservative block classifier used instead of evaluating
            every element when compiling a block map (patterns with closed forms provide it).
    """

    def __init__(
        self,
        fn: _Inner,
        name: str = "mask",
        *,
        batch_dependent: bool = False,
        head_dependent: bool = False,
        batch_size: int | None = None,
        num_heads: int | None = None,
        blocks: _BlockHint | None = None,
    ) -> None:
        self._fn = fn
        self.name = name
        self.batch_dependent = batch_dependent
        self.head_dependent = head_dependent
        self.batch_size = batch_size
        self.num_heads = num_heads
        self._blocks = blocks
        self._block_cache: dict[tuple, BlockMap] = {}

    def __repr__(self) -> str:
        return f"MaskFn({self.name})"

    # -- evaluation ---------------------------------------------------------------------
    def __call__(self, b, h, q_idx, kv_idx, q_len: int | None = None, kv_len: int | None = None):
        """Evaluate like a FlexAttention ``mask_mod``. Lengths default to the index extents."""
        if q_len is None:
            q_len = int(torch.as_tensor(q_idx).max()) + 1
        if kv_len is None:
            kv_len = int(torch.as_tensor(kv_idx).max()) + 1
        return self.evaluate(b, h, q_idx, kv_idx, q_len, kv_len)

    def evaluate(self, b, h, q_idx, kv_idx, q_len: int, kv_len: int) -> torch.Tensor:
        out = self._fn(b, h, q_idx, kv_idx, q_len, kv_len)
        out = torch.as_tensor(out)
        if out.dtype != torch.bool:
            raise MaskError(
                f"mask function {self.name!r} returned dtype {out.dtype}, expected torch.bool; "
                "build it from comparisons such as `q_idx >= kv_idx`"
            )
        return out

    def check_sizes(self, batch: int, heads: int) -> None:
        if self.batch_size is not None and self.batch_size not in (1, batch):
            raise MaskError(
                f"mask {self.name!r} was built for batch size {self.batch_size} but the call has batch {batch}; "
                "build the mask for this batch"
            )
        if self.num_heads is not None and self.num_heads not in (1, heads):
            raise MaskError(
                f"mask {self.name!r} was built for {self.num_heads} heads but the call has {heads} query heads"
            )

    def _index_grid(self, batch, heads, q_rows: torch.Tensor, kv_len: int, device):
        bm = batch if self.batch_dependent else 1
        hm = heads if self.head_dependent else 1
        b = torch.arange(bm, device=device).view(bm, 1, 1, 1)
        h = torch.arange(hm, device=device).view(1, hm, 1, 1)
        q = q_rows.to(device).view(1, 1, -1, 1)
        kv = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
        return b, h, q, kv, bm, hm

    def dense(
        self,
        batch: int = 1,
        heads: int = 1,
        q_len: int = 1,
        kv_len: int | None = None,
        *,
        device: torch.device | str | None = None,
        rows: torch.Tensor | None = None,
        expand: bool = False,
    ) -> torch.Tensor:
        """Materialise as a bool tensor ``(Bm, Hm, q_len, kv_len)``.

        ``Bm`` is 1 unless the mask depends on the batch index (likewise ``Hm``); pass
        ``expand=True`` to broadcast to ``(batch, heads, q_len, kv_len)``. ``rows`` selects a
        subset of query positions (then the third dim is ``len(rows)``).
        """
        kv_len = q_len if kv_len is None else kv_len
        self.check_sizes(batch, heads)
        device = torch.device(device) if device is not None else torch.device("cpu")
        q_rows = torch.arange(q_len, device=device) if rows is None else rows
        b, h, q, kv, bm, hm = self._index_grid(batch, heads, q_rows, kv_len, device)
        out = self.evaluate(b, h, q, kv, q_len, kv_len)
        out = torch.broadcast_to(out, (bm, hm, q.shape[2], kv_len))
        if expand:
            out = out.expand(batch, heads, q.shape[2], kv_len)
        return out

    def block_map(
        self,
        q_len: int,
        kv_len: int,
        block_q: int = 128,
        block_k: int = 128,
        *,
        batch: int = 1,
        heads: int = 1,
        device: torch.device | str | None = None,
    ) -> BlockMap:
        """Compile to a :class:`~headlab.attention.blocks.BlockMap` (cached per shape)."""
        from headlab.attention.blocks import BlockMap

        device = torch.device(device) if device is not None else torch.device("cpu")
        key = (q_len, kv_len, block_q, block_k, batch if self.batch_dependent else 1,
               heads if self.head_dependent else 1, str(device))
        cached = self._block_cache.get(key)
        if cached is None:
            cached = BlockMap.from_mask(self, q_len, kv_len, block_q, block_k, batch=batch, heads=heads, device=device)
            if len(self._block_cache) > 16:
                self._block_cache.clear()
            self._block_cache[key] = cached
        return cached

    def block_hint(self, q_len: int, kv_len: int, block_q: int, block_k: int, device) -> torch.Tensor | None:
        """Block states from the closed-form classifier, or None when there is none."""
        if self._blocks is None:
            return None
        return self._blocks(q_len, kv_len, block_q, block_k, device)

    # -- composition ----------------------------------------------------------------------
    def _combine(self, other: MaskFn, op: str) -> MaskFn:
        other = as_mask(other)
        f, g = self._fn, other._fn
        if op == "&":
            def fn(b, h, q, kv, lq, lk):
                return f(b, h, q, kv, lq, lk) & g(b, h, q, kv, lq, lk)
        else:
            def fn(b, h, q, kv, lq, lk):
                return f(b, h, q, kv, lq, lk) | g(b, h, q, kv, lq, lk)
        blocks = None
        if self._blocks is not None and other._blocks is not None:
            bf, bg = self._blocks, other._blocks
            reduce = torch.minimum if op == "&" else torch.maximum  # EMPTY < PARTIAL < FULL

            def blocks(lq, lk, bq, bk, device):
                return reduce(bf(lq, lk, bq, bk, device), bg(lq, lk, bq, bk, device))
        return MaskFn(
            fn,
            f"({self.name} {op} {other.name})",
            batch_dependent=self.batch_dependent or other.batch_dependent,
            head_dependent=self.head_dependent or other.head_dependent,
            batch_size=self.batch_size or other.batch_size,
            num_heads=self.num_heads or other.num_heads,
            blocks=blocks,
        )

    def __and__(self, other) -> MaskFn:
        return self._combine(other, "&")

    def __or__(self, other) -> MaskFn:
        return self._combine(other, "|")

    def __rand__(self, other) -> MaskFn:
        return as_mask(other)._combine(self, "&")

    def __ror__(self, other) -> MaskFn:
        return as_mask(other)._combine(self, "|")

    def __invert__(self) -> MaskFn:
        f = self._fn

        def fn(b, h, q, kv, lq, lk):
            return ~f(b, h, q, kv, lq, lk)

        blocks = None
        if self._blocks is not None:
            bf = self._blocks

            def blocks(lq, lk, bq, bk, device):
                return 2 - bf(lq, lk, bq, bk, device)  # FULL <-> EMPTY, PARTIAL stays

        return MaskFn(fn, f"~{self.name}", batch_dependent=self.batch_dependent,
                      head_dependent=self.head_dependent, batch_size=self.batch_size,
                      num_heads=self.num_heads, blocks=blocks)


def as_mask(f) -> MaskFn:
    """Wrap a plain ``f(b, h, q_idx, kv_idx) -> bool tensor`` as a :class:`MaskFn`.

    The function is assumed to depend on ``b`` and ``h`` (the safe choice); build a
    :class:`MaskFn` directly to declare otherwise.
    """
    if isinstance(f, MaskFn):
        return f
    if not callable(f):
        raise MaskError(
            f"expected a mask function f(b, h, q_idx, kv_idx) -> bool or a headlab.masks mask, got {type(f).__name__}"
        )
    name = getattr(f, "__name__", "mask")

    def fn(b, h, q, kv, lq, lk):
        return f(b, h, q, kv)

    return MaskFn(fn, name, batch_dependent=True, head_dependent=True)


# -- block classifiers with closed forms ----------------------------------------------------

def _block_bounds(n: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.arange(0, n, block, device=device)
    end = torch.clamp(start + block, max=n) - 1  # inclusive
    return start, end


def _diagonal_blocks(offset: int):
    """Blocks of ``q_idx + offset >= kv_idx``."""

    def blocks(lq, lk, bq, bk, device):
        qs, qe = _block_bounds(lq, bq, device)
        ks, ke = _block_bounds(lk, bk, device)
        full = (qs[:, None] + offset) >= ke[None, :]
        any_ = (qe[:, None] + offset) >= ks[None, :]
        state = torch.where(full, 2, torch.where(any_, 1, 0)).to(torch.int8)
        return state.view(1, 1, *state.shape)

    return blocks


# -- the masks ------------------------------------------------------------------------------

def full() -> MaskFn:
    """Every query sees every key (the identity of ``&``)."""

    def fn(b, h, q, kv, lq, lk):
        return torch.ones((), dtype=torch.bool, device=q.device).expand(torch.broadcast_shapes(q.shape, kv.shape))

    def blocks(lq, lk, bq, bk, device):
        return torch.full((1, 1, -(-lq // bq), -(-lk // bk)), 2, dtype=torch.int8, device=device)

    return MaskFn(fn, "full", blocks=blocks)


def causal() -> MaskFn:
    """Query i sees keys 0..i: exactly torch's ``is_causal=True`` (top-left aligned)."""

    def fn(b, h, q, kv, lq, lk):
        return q >= kv

    return MaskFn(fn, "causal", blocks=lambda lq, lk, bq, bk, d: _diagonal_blocks(0)(lq, lk, bq, bk, d))


def causal_lower_right() -> MaskFn:
    """Query i sees keys 0..i + (kv_len - q_len): the last query sees every key (KV-cache decoding)."""

    def fn(b, h, q, kv, lq, lk):
        return q + (lk - lq) >= kv

    def blocks(lq, lk, bq, bk, device):
        return _diagonal_blocks(lk - lq)(lq, lk, bq, bk, device)

    return MaskFn(fn, "causal_lower_right", blocks=blocks)


def padding(lengths: Sequence[int] | torch.Tensor) -> MaskFn:
    """Keys at positions ``>= lengths[b]`` are padding and are never attended to.

    Args:
        lengths: valid key length per batch element, shape ``(batch,)``.
    """
    lengths_t = torch.as_tensor(lengths, dtype=torch.long).flatten()
    if lengths_t.numel() == 0:
        raise ConfigError("padding(lengths) needs one length per batch element; got an empty list")
    if bool((lengths_t < 0).any()):
        raise ConfigError(f"padding lengths must be >= 0, got {lengths_t.tolist()}")

    def fn(b, h, q, kv, lq, lk):
        return kv < lengths_t.to(kv.device)[b]

    return MaskFn(fn, f"padding({lengths_t.tolist()})", batch_dependent=True, batch_size=lengths_t.numel())


# =========================================================================================
# Sparse patterns (issue 4). Each is a MaskFn with an EXACT closed-form block classifier:
# ``m.block_map(...)`` agrees tile for tile with reducing ``m.dense(...)`` (tested). Composing
# patterns with & | ~ keeps a classifier that is conservative (never calls a visible tile
# EMPTY nor a partly hidden tile FULL), so kernels stay exact.
#
# Sizes larger than the sequence are not errors: a window wider than the sequence sees the
# whole sequence, a pattern block larger than the sequence is one block, more global or
# random blocks than there are blocks means all of them. Zero or negative sizes raise
# ConfigError when the pattern is built; a block layout whose shape does not match the
# sequence raises MaskError when it is evaluated (that is when the length is known).
# A query row that sees no key is allowed: backends return zeros for it.
# =========================================================================================

__all__ += [
    "sliding_window",
    "dilated_window",
    "strided",
    "fixed",
    "global_tokens",
    "bigbird",
    "block_layout",
    "documents",
    "from_string",
    "pattern_names",
]


def _positive(name: str, value, what: str = "a positive integer") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{name} must be {what}, got {value}; a pattern needs at least one position")
    return value


def _nonneg(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value}")
    return value


def _offset_blocks(visible_offset):
    """Exact block classifier of a mask that depends only on ``delta = q_idx - kv_idx``.

    Inside a tile with rows ``[qs, qe]`` and columns ``[ks, ke]`` the offsets take every
    integer value in ``[qs - ke, qe - ks]``; the tile is FULL when all of them are visible and
    EMPTY when none is. Prefix sums over the visible offsets answer both per tile in O(1).
    ``visible_offset(delta, q_len, kv_len) -> bool`` is the mask as a function of the offset.
    """

    def blocks(lq, lk, bq, bk, device):
        deltas = torch.arange(-(lk - 1), lq, device=device)  # every offset a (q, kv) pair can have
        vis = visible_offset(deltas, lq, lk).to(torch.long)
        cs = torch.nn.functional.pad(torch.cumsum(vis, 0), (1, 0))  # cs[i] = visible offsets below index i
        qs, qe = _block_bounds(lq, bq, device)
        ks, ke = _block_bounds(lk, bk, device)
        lo = (qs[:, None] - ke[None, :]) + (lk - 1)  # index of the smallest offset in the tile
        hi = (qe[:, None] - ks[None, :]) + (lk - 1)
        count = cs[hi + 1] - cs[lo]
        state = torch.where(count == hi - lo + 1, 2, torch.where(count > 0, 1, 0)).to(torch.int8)
        return state.view(1, 1, *state.shape)

    return blocks


def _offset_mask(visible_offset, name: str) -> MaskFn:
    def fn(b, h, q, kv, lq, lk):
        return visible_offset(q - kv, lq, lk)

    return MaskFn(fn, name, blocks=_offset_blocks(visible_offset))


def sliding_window(window: int, causal: bool = False) -> MaskFn:
    """Local attention: query ``i`` sees keys ``j`` with ``|i - j| <= window`` (Longformer).

    With ``causal=True`` only the past half: ``0 <= i - j <= window`` (each query sees itself and
    the ``window`` keys before it; Mistral-style). Positions are top-left aligned like
    :func:`causal`. A window wider than the sequence sees everything.

    Args:
        window: largest distance ``|i - j|`` that is visible, ``>= 1``.
        causal: keep only keys at or before the query.

    ``sliding_window(1)`` and ``sliding_window(2, causal=True)`` on 5 positions::

        >>> from headlab import masks
        >>> masks.sliding_window(1).dense(q_len=5)[0, 0].int()
        tensor([[1, 1, 0, 0, 0],
                [1, 1, 1, 0, 0],
                [0, 1, 1, 1, 0],
                [0, 0, 1, 1, 1],
                [0, 0, 0, 1, 1]], dtype=torch.int32)
        >>> masks.sliding_window(2, causal=True).dense(q_len=5)[0, 0].int()
        tensor([[1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [1, 1, 1, 0, 0],
                [0, 1, 1, 1, 0],
                [0, 0, 1, 1, 1]], dtype=torch.int32)
    """
    w = _positive("sliding_window window", window)
    if causal:
        return _offset_mask(lambda d, lq, lk: (d >= 0) & (d <= w), f"sliding_window({w}, causal)")
    return _offset_mask(lambda d, lq, lk: d.abs() <= w, f"sliding_window({w})")


def dilated_window(window: int, dilation: int, causal: bool = False) -> MaskFn:
    """Dilated sliding window (Longformer): ``window`` keys on each side, ``dilation`` apart.

    Query ``i`` sees keys ``j = i + t * dilation`` for ``|t| <= window`` (``0 <= t`` with ``causal``):
    the receptive field reaches ``window * dilation`` positions on each side while each query
    still sees ``2 * window + 1`` keys. ``dilated_window(w, 1) == sliding_window(w)``.

        >>> from headlab import masks
        >>> masks.dilated_window(1, 2).dense(q_len=6)[0, 0].int()
        tensor([[1, 0, 1, 0, 0, 0],
                [0, 1, 0, 1, 0, 0],
                [1, 0, 1, 0, 1, 0],
                [0, 1, 0, 1, 0, 1],
                [0, 0, 1, 0, 1, 0],
                [0, 0, 0, 1, 0, 1]], dtype=torch.int32)
    """
    w = _positive("dilated_window window", window)
    s = _positive("dilated_window dilation", dilation)
    reach = w * s
    if causal:
        return _offset_mask(lambda d, lq, lk: (d >= 0) & (d <= reach) & (d % s == 0),
                            f"dilated_window({w}, {s}, causal)")
    return _offset_mask(lambda d, lq, lk: (d.abs() <= reach) & (d % s == 0), f"dilated_window({w}, {s})")


def strided(stride: int, causal: bool = True) -> MaskFn:
    """The Sparse Transformer's *strided* pattern (Child et al. 2019), both heads merged.

    Query ``i`` sees the previous ``stride`` keys (``0 <= i - j <= stride``, the local head) and
    every key a multiple of ``stride`` back (``(i - j) % stride == 0``, the strided head). As in
    the paper the pattern is causal (``j <= i``); ``causal=False`` mirrors it to both sides.
    About ``2 * sqrt(n)`` keys per query when ``stride ~ sqrt(n)``.

        >>> from headlab import masks
        >>> masks.strided(2).dense(q_len=6)[0, 0].int()
        tensor([[1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0],
                [0, 1, 1, 1, 0, 0],
                [1, 0, 1, 1, 1, 0],
                [0, 1, 0, 1, 1, 1]], dtype=torch.int32)
    """
    s = _positive("strided stride", stride)
    if causal:
        return _offset_mask(lambda d, lq, lk: (d >= 0) & ((d <= s) | (d % s == 0)), f"strided({s})")
    return _offset_mask(lambda d, lq, lk: (d.abs() <= s) | (d % s == 0), f"strided({s}, non-causal)")


def _prefix(flags: torch.Tensor) -> torch.Tensor:
    """``out[i] = flags[:i].sum()`` (length ``len(flags) + 1``) for interval counts."""
    return torch.nn.functional.pad(torch.cumsum(flags.to(torch.long), 0), (1, 0))


def fixed(stride: int, summary: int = 1, causal: bool = True) -> MaskFn:
    """The Sparse Transformer's *fixed* pattern (Child et al. 2019), both heads merged.

    Positions fall in blocks of ``stride``. Query ``i`` sees every key of its own block and
    the last ``summary`` keys ("summary" cells) of every block: ``j // stride == i // stride``
    or ``j % stride >= stride - summary``. As in the paper the pattern is causal (``j <= i``);
    ``causal=False`` keeps both directions (summary cells of later blocks too).

    Args:
        stride: block length ``l``, ``>= 1``.
        summary: summary cells per block ``c``, ``1 <= c <= stride``.

        >>> from headlab import masks
        >>> masks.fixed(3, 1).dense(q_len=7)[0, 0].int()
        tensor([[1, 0, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0, 0],
                [0, 0, 1, 1, 0, 0, 0],
                [0, 0, 1, 1, 1, 0, 0],
                [0, 0, 1, 1, 1, 1, 0],
                [0, 0, 1, 0, 0, 1, 1]], dtype=torch.int32)
    """
    s = _positive("fixed stride", stride)
    c = _positive("fixed summary", summary)
    if c > s:
        raise ConfigError(f"fixed summary={c} must be <= stride={s} (it counts cells inside each block)")

    def fn(b, h, q, kv, lq, lk):
        m = ((q // s) == (kv // s)) | ((kv % s) >= s - c)
        return (m & (kv <= q)) if causal else m

    def blocks(lq, lk, bq, bk, device):
        # Exact: per query row, count visible keys of every key tile with interval arithmetic,
        # then a tile is FULL when each of its rows sees all its keys, EMPTY when none sees any.
        qi = torch.arange(lq, device=device)
        ks, ke = _block_bounds(lk, bk, device)
        summ = _prefix(torch.arange(lk, device=device) % s >= s - c)  # (lk + 1,)
        hi_cap = qi[:, None] if causal else torch.full_like(qi[:, None], lk - 1)
        lo, hi = ks[None, :], torch.minimum(ke[None, :], hi_cap)  # keys of the tile the row may see

        def count_in(a, z):  # summary cells in [a, z] (empty when z < a)
            z = torch.clamp(z, min=-1, max=lk - 1)
            a = torch.clamp(a, min=0)
            return torch.where(z >= a, summ[z + 1] - summ[torch.minimum(a, z + 1)], 0)

        bs = (qi // s * s)[:, None]
        be = torch.minimum(bs + s - 1, hi_cap)
        b_lo, b_hi = torch.maximum(lo, bs), torch.minimum(hi, be)
        n_block = torch.clamp(b_hi - b_lo + 1, min=0)
        n_summ = count_in(lo, hi)
        n_both = torch.where(b_hi >= b_lo, count_in(b_lo, b_hi), 0)
        seen = n_block + n_summ - n_both  # (lq, n_kb) keys of each tile each row sees
        size = (ke - ks + 1)[None, :]
        nqb = -(-lq // bq)
        pad = nqb * bq - lq
        row_full = torch.nn.functional.pad((seen == size).to(torch.int8), (0, 0, 0, pad), value=1)
        row_any = torch.nn.functional.pad((seen > 0).to(torch.int8), (0, 0, 0, pad), value=0)
        full = row_full.view(nqb, bq, -1).amin(1) > 0
        any_ = row_any.view(nqb, bq, -1).amax(1) > 0
        state = torch.where(full, 2, torch.where(any_, 1, 0)).to(torch.int8)
        return state.view(1, 1, *state.shape)

    return MaskFn(fn, f"fixed({s}, {c}{'' if causal else ', non-causal'})", blocks=blocks)


def _index_set(name: str, indices) -> torch.Tensor:
    t = torch.as_tensor(indices, dtype=torch.long).flatten()
    if t.numel() == 0:
        raise ConfigError(f"{name} needs at least one index, got an empty list")
    if bool((t < 0).any()):
        raise ConfigError(f"{name} indices must be >= 0, got {t.tolist()}")
    return torch.unique(t)


def global_tokens(indices: Sequence[int] | torch.Tensor) -> MaskFn:
    """Longformer's global tokens: they see every key and every query sees them.

    Use it with ``|``: ``sliding_window(256) | global_tokens([0])``. Indices beyond the
    sequence are ignored.

        >>> from headlab import masks
        >>> masks.global_tokens([0]).dense(q_len=4)[0, 0].int()
        tensor([[1, 1, 1, 1],
                [1, 0, 0, 0],
                [1, 0, 0, 0],
                [1, 0, 0, 0]], dtype=torch.int32)
    """
    idx = _index_set("global_tokens", indices)

    def flags(n, device):
        f = torch.zeros(n, dtype=torch.bool, device=device)
        inside = idx[idx < n].to(device)
        f[inside] = True
        return f

    def fn(b, h, q, kv, lq, lk):
        n = max(lq, lk, int(q.max()) + 1, int(kv.max()) + 1)
        f = flags(n, q.device)
        return f[q] | f[kv]

    def blocks(lq, lk, bq, bk, device):
        cq, ck = _prefix(flags(lq, device)), _prefix(flags(lk, device))
        qs, qe = _block_bounds(lq, bq, device)
        ks, ke = _block_bounds(lk, bk, device)
        nq, nk = cq[qe + 1] - cq[qs], ck[ke + 1] - ck[ks]  # global rows / columns per tile
        full = (nq == qe - qs + 1)[:, None] | (nk == ke - ks + 1)[None, :]
        any_ = (nq > 0)[:, None] | (nk > 0)[None, :]
        state = torch.where(full, 2, torch.where(any_, 1, 0)).to(torch.int8)
        return state.view(1, 1, *state.shape)

    shown = idx.tolist() if idx.numel() <= 8 else idx[:8].tolist() + ["..."]
    return MaskFn(fn, f"global_tokens({shown})", blocks=blocks)


def _layout_mask(get_layout, bq_: int, bk_: int, name: str, *, heads: int | None = None) -> MaskFn:
    """A mask constant on ``bq_ x bk_`` cells: ``layout[(h,) q // bq_, kv // bk_]``.

    ``get_layout(n_q_cells, n_kv_cells, device)`` returns bool ``(Hm, n_q_cells, n_kv_cells)``.
    The block classifier is exact for any tile size: a tile is FULL when every cell it touches
    is on and EMPTY when none is (2-D prefix sums over the cell layout).
    """

    def cells(lq, lk, device):
        nq, nk = -(-lq // bq_), -(-lk // bk_)
        lay = get_layout(nq, nk, device)
        return lay

    def fn(b, h, q, kv, lq, lk):
        lay = cells(lq, lk, q.device)
        qc = torch.clamp(q, max=lq - 1) // bq_
        kc = torch.clamp(kv, max=lk - 1) // bk_
        if lay.shape[0] == 1:
            return lay[0][qc, kc]
        return lay[h, qc, kc]

    def blocks(lq, lk, bq, bk, device):
        lay = cells(lq, lk, device).to(torch.long)  # (Hm, nq, nk)
        cs = torch.nn.functional.pad(lay.cumsum(1).cumsum(2), (1, 0, 1, 0))  # (Hm, nq + 1, nk + 1)
        qs, qe = _block_bounds(lq, bq, device)
        ks, ke = _block_bounds(lk, bk, device)
        r0, r1 = (qs // bq_)[:, None], (qe // bq_ + 1)[:, None]  # cell rows touched by each tile
        c0, c1 = (ks // bk_)[None, :], (ke // bk_ + 1)[None, :]
        on = cs[:, r1, c1] - cs[:, r0, c1] - cs[:, r1, c0] + cs[:, r0, c0]
        area = (r1 - r0) * (c1 - c0)
        state = torch.where(on == area, 2, torch.where(on > 0, 1, 0)).to(torch.int8)
        return state.unsqueeze(0)  # (1, Hm, n_qb, n_kb)

    return MaskFn(fn, name, head_dependent=heads is not None and heads > 1, num_heads=heads, blocks=blocks)


def bigbird(block: int, window_blocks: int = 3, global_blocks: int = 2, random_blocks: int = 3,
            seed: int = 0) -> MaskFn:
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
    bsz = _positive("bigbird block", block)
    w = _positive("bigbird window_blocks", window_blocks)
    if w % 2 == 0:
        raise ConfigError(f"bigbird window_blocks must be odd (the block and as many on each side), got {w}")
    g = _nonneg("bigbird global_blocks", global_blocks)
    r = _nonneg("bigbird random_blocks", random_blocks)
    seed = int(seed)
    cache: dict[tuple, torch.Tensor] = {}

    def get_layout(nq, nk, device):
        key = (nq, nk)
        lay = cache.get(key)
        if lay is None:
            i = torch.arange(nq)[:, None]
            j = torch.arange(nk)[None, :]
            lay = (i - j).abs() <= w // 2
            lay = lay | (i < g) | (j < g)
            rr = min(r, nk)
            if rr:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + nq * 1009 + nk)
                picks = torch.stack([torch.randperm(nk, generator=gen)[:rr] for _ in range(nq)])  # (nq, rr)
                lay = lay.clone()
                lay[torch.arange(nq)[:, None], picks] = True
            cache[key] = lay = lay.unsqueeze(0)
        return lay.to(device)

    return _layout_mask(get_layout, bsz, bsz, f"bigbird({bsz}, {w}, {g}, {r}, seed={seed})")


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
            f"got shape {tuple(lay.shape)}")
    bq_, bk_ = (block, block) if not isinstance(block, tuple | list) else tuple(block)
    bq_ = _positive("block_layout block_q", bq_)
    bk_ = _positive("block_layout block_k", bk_)
    lay3 = lay if lay.dim() == 3 else lay.unsqueeze(0)  # (Hm, nq, nk)
    heads = lay3.shape[0] if lay.dim() == 3 else None

    def get_layout(nq, nk, device):
        if lay3.shape[1:] != (nq, nk):
            raise MaskError(
                f"block_layout has {lay3.shape[1]} x {lay3.shape[2]} blocks of {bq_} x {bk_} but the call needs "
                f"{nq} x {nk} (ceil(q_len / {bq_}) x ceil(kv_len / {bk_})); build the layout for this length")
        return lay3.to(device)

    return _layout_mask(get_layout, bq_, bk_, f"block_layout({tuple(lay.shape)}, {bq_}x{bk_})", heads=heads)


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
                f"has q_len={lq}, kv_len={lk}; the lengths must add up to the sequence length")
        return torch.bucketize(torch.arange(n, device=device), ends.to(device), right=True)

    def fn(b, h, q, kv, lq, lk):
        n = max(lq, lk, int(q.max()) + 1, int(kv.max()) + 1)
        d = doc_ids(n, lq, lk, q.device)
        return d[q] == d[kv]

    def blocks(lq, lk, bq, bk, device):
        d = doc_ids(max(lq, lk), lq, lk, device)
        qs, qe = _block_bounds(lq, bq, device)
        ks, ke = _block_bounds(lk, bk, device)
        dq0, dq1, dk0, dk1 = d[qs][:, None], d[qe][:, None], d[ks][None, :], d[ke][None, :]
        any_ = (dq0 <= dk1) & (dk0 <= dq1)  # document ranges overlap (ids are sorted)
        full = (dq0 == dq1) & (dk0 == dk1) & (dq0 == dk0)
        state = torch.where(full, 2, torch.where(any_, 1, 0)).to(torch.int8)
        return state.view(1, 1, *state.shape)

    shown = lens.tolist() if lens.numel() <= 8 else lens[:8].tolist() + ["..."]
    return MaskFn(fn, f"documents({shown})", blocks=blocks)


# -- parsing CLI specs ----------------------------------------------------------------------

_PATTERNS: dict[str, Callable[..., MaskFn]] = {
    "full": full,
    "causal": causal,
    "causal_lower_right": causal_lower_right,
    "padding": padding,
    "sliding_window": sliding_window,
    "dilated_window": dilated_window,
    "strided": strided,
    "fixed": fixed,
    "global_tokens": global_tokens,
    "bigbird": bigbird,
    "documents": documents,
}


def pattern_names() -> list[str]:
    """Names :func:`from_string` understands (``block_layout`` needs a tensor, so it is not one)."""
    return list(_PATTERNS)


def _parse_arg(text: str, spec: str):
    t = text.strip()
    low = t.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    try:
        if "," in t:
            return [int(x) for x in t.split(",") if x.strip() != ""]
        return int(t)
    except ValueError:
        raise ConfigError(f"cannot read {text!r} in mask spec {spec!r}: arguments are integers, "
                          "comma-separated integer lists, true/false or name=value") from None


def _build_term(term: str, spec: str) -> MaskFn:
    import inspect

    parts = [p.strip() for p in term.split(":")]
    name = parts[0]
    if name not in _PATTERNS:
        raise ConfigError(f"unknown mask pattern {name!r} in {spec!r}; known patterns: {', '.join(_PATTERNS)}")
    ctor = _PATTERNS[name]
    params = inspect.signature(ctor).parameters
    args, kwargs = [], {}
    for p in parts[1:]:
        if "=" in p:
            key, _, val = p.partition("=")
            kwargs[key.strip()] = _parse_arg(val, spec)
        elif p in params and params[p].default is False:  # a bare flag such as "causal"
            kwargs[p] = True
        else:
            args.append(_parse_arg(p, spec))
    try:
        inspect.signature(ctor).bind(*args, **kwargs)
    except TypeError as e:
        usage = ":".join([name, *params])
        raise ConfigError(f"mask spec {term!r} does not fit {name}({', '.join(params)}): {e}; "
                          f"write it as {usage}") from None
    return ctor(*args, **kwargs)


def from_string(text: str) -> MaskFn:
    """Build a mask from a command-line spec.

    Grammar: a pattern is ``name`` followed by ``:``-separated arguments in the order of the
    constructor's parameters (integers, comma lists such as ``0,5,9``, ``true``/``false``,
    ``name=value``, or a bare flag name such as ``causal``). Patterns combine with ``&``
    (both), ``|`` (either) and ``~`` (not); ``&`` binds tighter than ``|``; parentheses group.
    Spaces are ignored.

        sliding_window:256            |i - j| <= 256
        sliding_window:256:causal     0 <= i - j <= 256   (same as sliding_window:256&causal)
        dilated_window:128:2          Longformer dilated window
        strided:64   fixed:64:4       Sparse Transformer patterns (causal, as in the paper)
        bigbird:64:3:2:2:0            block, window_blocks, global_blocks, random_blocks, seed
        sliding_window:128|global_tokens:0,1
        documents:100,200,300&causal

        >>> from headlab import masks
        >>> m = masks.from_string("sliding_window:1 & causal")
        >>> m.dense(q_len=4)[0, 0].int()
        tensor([[1, 0, 0, 0],
                [1, 1, 0, 0],
                [0, 1, 1, 0],
                [0, 0, 1, 1]], dtype=torch.int32)
        >>> masks.from_string("banana:3")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        headlab.errors.ConfigError: unknown mask pattern 'banana' in 'banana:3'; known patterns: full, causal, ...
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"a mask spec must be a non-empty string such as 'sliding_window:256', got {text!r}")
    spec = text
    tokens: list[str] = []
    buf = ""
    for ch in text.replace(" ", ""):
        if ch in "&|~()":
            if buf:
                tokens.append(buf)
                buf = ""
            tokens.append(ch)
        else:
            buf += ch
    if buf:
        tokens.append(buf)
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        tok = peek()
        pos += 1
        return tok

    def expr():
        m = conj()
        while peek() == "|":
            take()
            m = m | conj()
        return m

    def conj():
        m = unary()
        while peek() == "&":
            take()
            m = m & unary()
        return m

    def unary():
        tok = take()
        if tok == "~":
            return ~unary()
        if tok == "(":
            m = expr()
            if take() != ")":
                raise ConfigError(f"unbalanced parentheses in mask spec {spec!r}")
            return m
        if tok is None or tok in "&|)":
            raise ConfigError(f"mask spec {spec!r} is missing a pattern (near {tok or 'the end'!r})")
        return _build_term(tok, spec)

    m = expr()
    if pos != len(tokens):
        raise ConfigError(f"unexpected {tokens[pos]!r} in mask spec {spec!r}; combine patterns with & | ~")
    return m
