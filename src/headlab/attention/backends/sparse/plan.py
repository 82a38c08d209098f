"""The plan of the block-sparse kernel: which tiles a mask leaves non-empty, grouped into
batched work (cached with the mask object); and :func:`pattern_density`, how much of one head's
score matrix a mask leaves visible, by pairs and by the kernel's tiles (``headlab pattern``)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from headlab.errors import ConfigError, MaskError
from headlab.spec.blocks import BlockMap, cached_per_mask
from headlab.spec.blocks import block_map as _compile
from headlab.spec.masks import MaskFn, causal, full
from headlab.spec.tile_states import EMPTY, FULL, PARTIAL

# Tile sizes of the kernel; the cost model reads the same constants.
BLOCK_Q = 128
BLOCK_K = 128

_CAUSAL = causal()
_FULL = full()  # a call without a mask: every tile is visited
_WITH_CAUSAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mask -> mask & causal()
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mask -> {shape key: plan}


def effective_mask(mask: MaskFn | None, is_causal: bool) -> MaskFn | None:
    """The mask the kernel walks: ``mask``, ANDed with ``causal()`` when ``is_causal`` (cached); without
    either, ``full()``: every tile is visited."""
    if not is_causal:
        return _FULL if mask is None else mask
    if mask is None:
        return _CAUSAL
    combined = _WITH_CAUSAL.get(mask)
    if combined is None:
        combined = _WITH_CAUSAL[mask] = mask & _CAUSAL
    return combined


def block_map(
    mask: MaskFn,
    q_len: int,
    kv_len: int,
    batch: int,
    heads: int,
    block_q: int | None = None,
    block_k: int | None = None,
) -> BlockMap:
    """The block map the kernel walks for this mask and shape (tiles default to BLOCK_Q x BLOCK_K)."""
    return _compile(mask, q_len, kv_len, block_q or BLOCK_Q, block_k or BLOCK_K, batch=batch, heads=heads)


def visited_tiles(bm: BlockMap, batch: int, heads: int) -> int:
    """Non-empty tiles summed over every (batch, query head): exactly the tiles the kernel computes."""
    bm_, hm_ = bm.state.shape[:2]
    per = int((bm.state != EMPTY).sum())
    return per * (batch // bm_) * (heads // hm_)


@dataclass(frozen=True)
class PatternDensity:
    """How much of one head's ``seq_len x seq_len`` score matrix a mask leaves visible.

    The tile counts are those of the block map the sparse kernel walks (``tile x tile`` tiles): a
    visited tile is computed, a full one needs no element mask.
    """

    seq_len: int  # queries = keys
    head: int  # the query head counted (0 for a mask the same on every head)
    visible: torch.Tensor  # (seq_len, seq_len) bool: query i sees key j; what a drawing shows
    visible_pairs: int  # (query, key) pairs the mask lets through
    tile: int  # side of the square tiles counted
    tiles: int  # tiles of the matrix, visited or not
    visited_tiles: int  # tiles with a visible pair: the ones the kernel computes
    full_tiles: int  # tiles whose every pair is visible
    rows_without_keys: int  # query rows that see no key (their output is zeros)

    @property
    def pair_density(self) -> float:
        """Share of (query, key) pairs visible."""
        return self.visible_pairs / self.seq_len**2

    @property
    def tile_density(self) -> float:
        """Share of tiles visited."""
        return self.visited_tiles / self.tiles

    @property
    def full_tile_share(self) -> float:
        """Share of all tiles (visited or not) that are full."""
        return self.full_tiles / self.tiles


def default_tile(seq_len: int) -> int:
    """The tile :func:`pattern_density` counts by default: the kernel's ``BLOCK_Q``, or ``seq_len // 8``
    (at least 1) when that is smaller, so a short sequence still shows several tiles."""
    return max(1, min(BLOCK_Q, seq_len // 8))


def pattern_density(mask: MaskFn, seq_len: int, *, tile: int | None = None, head: int = 0) -> PatternDensity:
    """Visible pairs and visited tiles of ``mask`` on query head ``head`` at ``seq_len`` positions.

    >>> from headlab import masks
    >>> d = pattern_density(masks.causal(), 8, tile=4)
    >>> d.visible_pairs, d.visited_tiles, d.full_tiles, d.tiles
    (36, 3, 1, 4)
    >>> round(d.pair_density, 4), d.tile_density
    (0.5625, 0.75)
    """
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be positive, got {seq_len}")
    tile = default_tile(seq_len) if tile is None else tile
    if tile <= 0:
        raise ConfigError(f"tile must be positive, got {tile}")
    heads = mask.num_heads or 1
    if not 0 <= head < heads:
        raise ConfigError(f"head must be in 0..{heads - 1} for mask {mask.name!r}, got {head}")
    dense = mask.dense(heads=heads, q_len=seq_len)  # (1, Hm, seq_len, seq_len)
    visible = dense[0, min(head, dense.shape[1] - 1)]
    bm = _compile(mask, seq_len, seq_len, tile, tile, heads=heads)
    state = bm.state[0, min(head, bm.state.shape[1] - 1)]  # (n_q_blocks, n_kv_blocks)
    return PatternDensity(
        seq_len,
        head,
        visible,
        int(visible.sum()),
        tile,
        int(state.numel()),
        int((state != EMPTY).sum()),
        int((state == FULL).sum()),
        int((~visible.any(-1)).sum()),
    )


@dataclass
class TileGroup:
    """Items that visit ``k`` key blocks; the compact part is shared by ``reps`` (batch, head) copies."""

    k: int
    qb: torch.Tensor  # (n0,) query block of each compact item
    items: torch.Tensor  # (reps, n0) flat index into the item axis of q_flat / out_flat
    kv: torch.Tensor  # (reps, n0, k) flat index into the block axis of k_flat / v_flat
    slots: torch.Tensor  # (n0, k) key block visited by each compact item, in order
    need: torch.Tensor | None  # (P, 2) (compact item, slot) pairs that need the element mask
    need_bh: torch.Tensor | None  # (P, 2) (mask batch index, mask head index) of those pairs
    mask_runs: list = field(default_factory=list)  # [(j0, j1)] slot columns holding partial tiles
    tile_masks: tuple | None = None  # ([(j0, j1, bias)], dead rows (n0, bq) or None, device), on first use


@dataclass
class SparsePlan:
    """Everything the kernel needs about one (mask, shape): built once, cached with the mask."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    head_dependent: bool  # items are (batch, query head, q block); else (batch, kv head, q block)
    n_qb: int
    n_kb: int
    groups: list[TileGroup] = field(default_factory=list)
    tiles: int = 0  # visited (batch, query head, q tile, k tile) tiles
    units: list | None = None  # forward work units (see _units), built on first use

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads

    @property
    def head_slots(self) -> int:
        return self.heads if self.head_dependent else self.kv_heads

    @property
    def rows(self) -> int:
        """Query rows per item: one block, or the G heads sharing a kv head stacked."""
        return self.block_q if self.head_dependent else self.group_size * self.block_q


def plan_for(
    mask: MaskFn,
    batch: int,
    heads: int,
    kv_heads: int,
    q_len: int,
    kv_len: int,
    block_q: int | None = None,
    block_k: int | None = None,
) -> SparsePlan:
    """Group the visited tiles of ``mask`` into batched work (cached on the mask object)."""
    key = (batch, heads, kv_heads, q_len, kv_len, block_q or BLOCK_Q, block_k or BLOCK_K)
    return cached_per_mask(_PLANS, mask, key, lambda: _build_plan(mask, *key), limit=8)


def _build_plan(mask, B, H, Hkv, Lq, Lk, bq, bk) -> SparsePlan:
    bm = block_map(mask, Lq, Lk, B, H, bq, bk)
    state = bm.state.cpu()
    Bm, Hm, nqb, nkb = state.shape
    if Bm not in (1, B) or Hm not in (1, H):
        raise MaskError(
            f"mask {mask.name!r} has block states for batch {Bm} x heads {Hm}, but the call has batch {B} x heads {H}"
        )
    head_dep = Hm > 1
    plan = SparsePlan(B, H, Hkv, Lq, Lk, bq, bk, head_dep, nqb, nkb)
    G = H // Hkv
    Hs = plan.head_slots
    visible = state != EMPTY
    need = state == PARTIAL
    if Lk % bk:
        need[..., -1] |= visible[..., -1]  # the padded last key block must hide its padding
    counts = visible.sum(-1)  # (Bm, Hm, nqb)
    # replication of each compact (bm, hm) slice over the real (batch, head slot) items
    b_rep = torch.arange(B) if Bm == 1 else None
    h_rep = torch.arange(Hs) if Hm == 1 else None
    for k in sorted(set(counts.flatten().tolist()) - {0}):
        sel = torch.nonzero(counts == k)  # (n0, 3): bm, hm, qb
        sb, sh, sq = sel.unbind(1)
        slots = torch.nonzero(visible[sb, sh, sq])[:, 1].view(-1, k)  # (n0, k) key blocks, ascending
        if b_rep is not None and h_rep is not None:
            ib = b_rep.repeat_interleave(Hs)[:, None]  # (reps, 1)
            ih = h_rep.repeat(B)[:, None]
        elif b_rep is not None:
            ib, ih = b_rep[:, None], sh[None, :]
        elif h_rep is not None:
            ib, ih = sb[None, :], h_rep[:, None]
        else:
            ib, ih = sb[None, :], sh[None, :]
        items = (ib * Hs + ih) * nqb + sq[None, :]  # (reps, n0)
        hk = ih // G if head_dep else ih
        kv = ((ib * Hkv + hk) * nkb)[..., None] + slots[None]  # (reps, n0, k)
        items = items.contiguous()
        kv = kv.expand(items.shape[0], items.shape[1], k).contiguous()
        nd = need[sb, sh, sq][torch.arange(len(sq))[:, None], slots]  # (n0, k)
        pairs = torch.nonzero(nd)
        grp = TileGroup(k, sq, items, kv, slots, None, None)
        if pairs.numel():
            grp.need = pairs
            cols = sorted(set(pairs[:, 1].tolist()))
            runs: list[list[int]] = []
            for c in cols:  # consecutive slot columns merged into runs
                if runs and runs[-1][1] == c:
                    runs[-1][1] = c + 1
                else:
                    runs.append([c, c + 1])
            grp.mask_runs = [tuple(r) for r in runs]
            grp.need_bh = torch.stack([sb[pairs[:, 0]], sh[pairs[:, 0]]], 1)
        plan.groups.append(grp)
        plan.tiles += items.numel() * k * (1 if head_dep else G)
    return plan
