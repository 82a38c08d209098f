"""Mask algebra: :class:`MaskFn` (a composable ``f(b, h, q_idx, kv_idx) -> bool``), :func:`as_mask`,
and the basic masks ``full``, ``causal``, ``causal_lower_right``, ``padding``.

A mask carries an optional closed-form *block classifier* (tile states EMPTY / PARTIAL / FULL,
:mod:`headlab.spec.tile_states`); :func:`headlab.spec.blocks.block_map` compiles a mask to a
block map with it (or by dense evaluation when there is none). Masks never import the block map.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

import headlab.checks as checks
from headlab.errors import ConfigError, MaskError
from headlab.spec.tile_states import EMPTY, FULL, PARTIAL

# fn(b, h, q_idx, kv_idx, q_len, kv_len) -> bool tensor broadcastable to the index shapes
_Inner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]
# blocks(q_len, kv_len, block_q, block_k, device[, rows=(i0, i1)]) -> int8 (Bm, Hm, n_qb, n_kb) of
# EMPTY/PARTIAL/FULL; with ``rows``, only the tile rows [i0, i1): (Bm, Hm, i1 - i0, n_kb)
_BlockHint = Callable[..., torch.Tensor]
Rows = tuple[int, int] | None

__all__ = ["MaskFn", "as_mask", "causal", "causal_lower_right", "full", "padding"]


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
            One that takes a ``rows=(i0, i1)`` keyword answers for those tile rows alone, so a
            map can be streamed a few rows at a time (every built-in classifier does).
        check: optional ``check(q_len, kv_len)`` run when this mask itself is evaluated or
            compiled (not when it is part of a composition): a pattern that would be silently
            empty at a length raises there.
        offsets: ``(lo, hi)`` when this mask is a band: it shows exactly the pairs with
            ``lo <= q_idx - kv_idx <= hi`` (None = unbounded), for every ``b``, ``h`` and length.
            A leaf declares it; :func:`headlab.masks.band_of` derives the band of a composition.
    """

    # set by the pattern builders on the masks they make (the cost model and the name read them); absent otherwise
    lengths: list[int]  # padding, documents: a length per batch element / per document
    indices: list[int]  # global tokens
    cell: tuple[int, int]  # cell patterns: positions per cell (rows, columns)
    cell_rows: Callable  # cell_rows(q_len, kv_len, device, c0, c1) -> bool (Hm, c1 - c0, n_kv_cells)
    bigbird: dict[str, int]
    layout: torch.Tensor  # bool (Hm, n_q_blocks, n_kv_blocks)

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
        check: Callable[[int, int], None] | None = None,
        offsets: tuple[int | None, int | None] | None = None,
    ) -> None:
        self._fn = fn
        self.name = name
        self.batch_dependent = batch_dependent
        self.head_dependent = head_dependent
        self.batch_size = batch_size
        self.num_heads = num_heads
        self._blocks = blocks
        self._blocks_rows = blocks is not None and "rows" in inspect.signature(blocks).parameters
        self._check = check
        self.offsets = offsets  # a leaf's band of visible offsets; read it through band_of
        self.parts: tuple = ()  # ("&" | "|", a, b) or ("~", a) for a composition: what the cost model reads

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
        if self._check is not None:
            self._check(q_len, kv_len)
        out = self._fn(b, h, q_idx, kv_idx, q_len, kv_len)
        out = torch.as_tensor(out)
        if out.dtype != torch.bool:
            raise MaskError(
                f"mask function {self.name!r} returned dtype {out.dtype}, expected torch.bool; "
                "build it from comparisons such as `q_idx >= kv_idx`"
            )
        return out

    def check_sizes(self, batch: int, heads: int) -> None:
        # a mask that depends on the batch index is evaluated at every index of the call's batch: it must have been
        # built for that batch (padding([3]) for a batch of 2 has no length for the second element)
        if (
            self.batch_dependent
            and self.batch_size is not None
            and self.batch_size != batch
            and getattr(self, "lengths", None) is not None
        ):
            n = len(self.lengths)
            raise MaskError(
                f"{self.name} has {n} length{'s' if n != 1 else ''} (it was built for batch size {n}) but "
                f"the call has a batch of {batch}; give one valid key length per batch element"
            )
        if self.batch_size is not None and self.batch_size not in ((batch,) if self.batch_dependent else (1, batch)):
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
        for name, val in (("batch", batch), ("heads", heads), ("q_len", q_len), ("kv_len", kv_len)):
            checks.positive_int(name, val)
        self.check_sizes(batch, heads)
        device = torch.device(device) if device is not None else torch.device("cpu")
        q_rows = torch.arange(q_len, device=device) if rows is None else rows
        b, h, q, kv, bm, hm = self._index_grid(batch, heads, q_rows, kv_len, device)
        out = self.evaluate(b, h, q, kv, q_len, kv_len)
        out = torch.broadcast_to(out, (bm, hm, q.shape[2], kv_len))
        if expand:
            out = out.expand(batch, heads, q.shape[2], kv_len)
        return out

    def block_hint(
        self, q_len: int, kv_len: int, block_q: int, block_k: int, device, rows: Rows = None
    ) -> torch.Tensor | None:
        """Block states ``(Bm, Hm, n_q_blocks, n_kv_blocks)`` from the closed-form classifier, or None
        when there is none (:func:`headlab.spec.blocks.block_map` then evaluates the mask).
        ``rows=(i0, i1)``: only tile rows ``[i0, i1)``, ``(Bm, Hm, i1 - i0, n_kv_blocks)``."""
        if self._check is not None:
            self._check(q_len, kv_len)
        return self._hint(q_len, kv_len, block_q, block_k, device, rows)

    def _hint(self, lq, lk, bq, bk, device, rows: Rows):
        if self._blocks is None:
            return None
        if rows is None:
            return self._blocks(lq, lk, bq, bk, device)
        if self._blocks_rows:
            return self._blocks(lq, lk, bq, bk, device, rows=rows)
        return self._blocks(lq, lk, bq, bk, device)[:, :, rows[0] : rows[1]]  # a classifier without rows=

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
            a, c = self, other
            reduce = torch.minimum if op == "&" else torch.maximum  # EMPTY < PARTIAL < FULL

            def blocks(lq, lk, bq, bk, device, rows=None):
                return reduce(a._hint(lq, lk, bq, bk, device, rows), c._hint(lq, lk, bq, bk, device, rows))

        out = MaskFn(
            fn,
            f"({self.name} {op} {other.name})",
            batch_dependent=self.batch_dependent or other.batch_dependent,
            head_dependent=self.head_dependent or other.head_dependent,
            batch_size=self.batch_size or other.batch_size,
            num_heads=self.num_heads or other.num_heads,
            blocks=blocks,
        )
        out.parts = (op, self, other)
        return out

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
            a = self

            def blocks(lq, lk, bq, bk, device, rows=None):
                return FULL - a._hint(lq, lk, bq, bk, device, rows)  # FULL <-> EMPTY, PARTIAL stays

        out = MaskFn(
            fn,
            f"~{self.name}",
            batch_dependent=self.batch_dependent,
            head_dependent=self.head_dependent,
            batch_size=self.batch_size,
            num_heads=self.num_heads,
            blocks=blocks,
        )
        out.parts = ("~", self)
        return out


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


def block_bounds(n: int, block: int, device, rows: Rows = None) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last position of every tile (of the tiles ``[i0, i1)`` with ``rows``)."""
    i0, i1 = rows if rows is not None else (0, -(-n // block))
    start = torch.arange(i0 * block, min(n, i1 * block), block, device=device)
    end = torch.clamp(start + block, max=n) - 1  # inclusive
    return start, end


def _diagonal_blocks(offset: int):
    """Blocks of ``q_idx + offset >= kv_idx``."""

    def blocks(lq, lk, bq, bk, device, rows=None):
        qs, qe = block_bounds(lq, bq, device, rows)
        ks, ke = block_bounds(lk, bk, device)
        full = (qs[:, None] + offset) >= ke[None, :]
        any_ = (qe[:, None] + offset) >= ks[None, :]
        state = torch.where(full, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8)
        return state.view(1, 1, *state.shape)

    return blocks


# -- the masks ------------------------------------------------------------------------------


def full() -> MaskFn:
    """Every query sees every key (the identity of ``&``)."""

    def fn(b, h, q, kv, lq, lk):
        return torch.ones((), dtype=torch.bool, device=q.device).expand(torch.broadcast_shapes(q.shape, kv.shape))

    def blocks(lq, lk, bq, bk, device, rows=None):
        n_qb = -(-lq // bq) if rows is None else rows[1] - rows[0]
        return torch.full((1, 1, n_qb, -(-lk // bk)), FULL, dtype=torch.int8, device=device)

    return MaskFn(fn, "full", blocks=blocks, offsets=(None, None))


def causal() -> MaskFn:
    """Query i sees keys 0..i: exactly torch's ``is_causal=True`` (top-left aligned)."""

    def fn(b, h, q, kv, lq, lk):
        return q >= kv

    return MaskFn(fn, "causal", blocks=_diagonal_blocks(0), offsets=(0, None))


def causal_lower_right() -> MaskFn:
    """Query i sees keys 0..i + (kv_len - q_len): the last query sees every key (KV-cache decoding)."""

    def fn(b, h, q, kv, lq, lk):
        return q + (lk - lq) >= kv

    def blocks(lq, lk, bq, bk, device, rows=None):
        return _diagonal_blocks(lk - lq)(lq, lk, bq, bk, device, rows)

    return MaskFn(fn, "causal_lower_right", blocks=blocks)


def padding(lengths: Sequence[int] | torch.Tensor) -> MaskFn:
    """Keys at positions ``>= lengths[b]`` are padding and are never attended to.

    Args:
        lengths: valid key length per batch element, shape ``(batch,)``.
    """
    try:
        given = torch.as_tensor(lengths)
    except (TypeError, ValueError, RuntimeError):  # None, a string, a dict, a ragged list
        raise ConfigError(
            f"padding(lengths) needs one length per batch element (a list or a 1-D tensor of "
            f"integers); got {type(lengths).__name__}"
        ) from None
    if (
        given.dtype == torch.bool
        or given.is_complex()
        or (given.is_floating_point() and not bool((torch.isfinite(given) & (given == given.round())).all()))
    ):  # 2.5 would be truncated to 2, True read as 1
        raise ConfigError(f"padding lengths must be whole numbers, one per batch element; got {given.tolist()}")
    lengths_t = given.to(torch.long).flatten()
    if lengths_t.numel() == 0:
        raise ConfigError("padding(lengths) needs one length per batch element; got an empty list")
    if bool((lengths_t < 0).any()):
        raise ConfigError(f"padding lengths must be >= 0, got {lengths_t.tolist()}")

    def fn(b, h, q, kv, lq, lk):
        return kv < lengths_t.to(kv.device)[b]

    def blocks(lq, lk, bq, bk, device, rows=None):
        # exact: a key tile is FULL when its last key is valid, EMPTY when its first is not (every row alike)
        n_qb = -(-lq // bq) if rows is None else rows[1] - rows[0]
        ks, ke = block_bounds(lk, bk, device)
        n = lengths_t.to(device)[:, None]
        state = torch.where(ke[None, :] < n, FULL, torch.where(ks[None, :] < n, PARTIAL, EMPTY)).to(torch.int8)
        return state[:, None, None, :].expand(-1, 1, n_qb, -1).contiguous()  # (B, 1, n_qb, n_kb)

    m = MaskFn(fn, f"padding({lengths_t.tolist()})", batch_dependent=True, batch_size=lengths_t.numel(), blocks=blocks)
    m.lengths = lengths_t.tolist()  # the valid key length of each batch element (the cost model reads it)
    return m


def prefix_length(flags: torch.Tensor) -> torch.Tensor:
    """``out[i] = flags[:i].sum()`` (length ``len(flags) + 1``) for interval counts."""
    return torch.nn.functional.pad(torch.cumsum(flags.to(torch.long), 0), (1, 0))
