"""``"sparse"``: exact block-sparse attention that visits only the tiles a mask leaves non-empty.

The mask (a :mod:`headlab.masks` function, ANDed with ``causal`` when asked) is compiled to a
:class:`~headlab.attention.blocks.BlockMap` of ``BLOCK_Q x BLOCK_K`` tiles. Only non-empty tiles
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
thread). Scores are in base 2 (``log2(e)`` folded into the query scale; ``exp2`` is about twice
as fast as ``exp``), partial tiles get an additive 0/-inf bias (much faster than a bool
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

import threading
import weakref
from dataclasses import dataclass, field

import torch

from headlab.attention.backends._threads import run_units
from headlab.attention.backends.base import Backend, Capabilities, register
from headlab.attention.blocks import EMPTY, PARTIAL, BlockMap
from headlab.attention.guard import check_fits
from headlab.attention.masks import MaskFn, causal
from headlab.attention.spec import AttentionSpec
from headlab.errors import MaskError

# Tile sizes of the kernel; the cost model reads the same constants.
BLOCK_Q = 128
BLOCK_K = 128
# Score entries computed at once (per chunk); bounds the working set to a few such buffers.
CHUNK_ELEMENTS = 1 << 20

_CAUSAL = causal()
_WITH_CAUSAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mask -> mask & causal()
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mask -> {shape key: plan}


def effective_mask(mask: MaskFn | None, is_causal: bool) -> MaskFn | None:
    """The mask the kernel walks: ``mask``, ANDed with ``causal()`` when ``is_causal`` (cached)."""
    if not is_causal:
        return mask
    if mask is None:
        return _CAUSAL
    combined = _WITH_CAUSAL.get(mask)
    if combined is None:
        combined = _WITH_CAUSAL[mask] = mask & _CAUSAL
    return combined


def block_map(mask: MaskFn, q_len: int, kv_len: int, batch: int, heads: int,
              block_q: int | None = None, block_k: int | None = None) -> BlockMap:
    """The block map the kernel walks for this mask and shape (tiles default to BLOCK_Q x BLOCK_K)."""
    return mask.block_map(q_len, kv_len, block_q or BLOCK_Q, block_k or BLOCK_K, batch=batch, heads=heads)


def visited_tiles(bm: BlockMap, batch: int, heads: int) -> int:
    """Non-empty tiles summed over every (batch, query head): exactly the tiles the kernel computes."""
    bm_, hm_ = bm.state.shape[:2]
    per = int((bm.state != EMPTY).sum())
    return per * (batch // bm_) * (heads // hm_)


@dataclass
class _Group:
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
    groups: list[_Group] = field(default_factory=list)
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


def plan_for(mask: MaskFn, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int,
             block_q: int | None = None, block_k: int | None = None) -> SparsePlan:
    """Group the visited tiles of ``mask`` into batched work (cached on the mask object)."""
    key = (batch, heads, kv_heads, q_len, kv_len, block_q or BLOCK_Q, block_k or BLOCK_K)
    cache = _PLANS.get(mask)
    if cache is None:
        cache = _PLANS[mask] = {}
    plan = cache.get(key)
    if plan is None:
        if len(cache) > 8:
            cache.clear()
        plan = cache[key] = _build_plan(mask, *key)
    return plan


def _build_plan(mask, B, H, Hkv, Lq, Lk, bq, bk) -> SparsePlan:
    bm = block_map(mask, Lq, Lk, B, H, bq, bk)
    state = bm.state.cpu()
    Bm, Hm, nqb, nkb = state.shape
    if Bm not in (1, B) or Hm not in (1, H):
        raise MaskError(f"mask {mask.name!r} has block states for batch {Bm} x heads {Hm}, "
                        f"but the call has batch {B} x heads {H}")
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
        grp = _Group(k, sq, items, kv, slots, None, None)
        if pairs.numel():
            grp.need = pairs
            cols = sorted(set(pairs[:, 1].tolist()))
            runs = []
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


def _hidden(plan: SparsePlan, grp: _Group, mask: MaskFn, device):
    """``([(j0, j1, bias (n0, block_q, j1 - j0, block_k))], dead rows (n0, block_q) or None)``,
    or None when every tile of the group is FULL. ``bias`` is 0 where a score is visible and
    -inf where it is hidden, for each run ``[j0, j1)`` of slot columns holding partial tiles.
    The mask is evaluated on the partial tiles only, once, and cached in ``grp.tile_masks``;
    dead rows are those that see no key at all (they output zeros)."""
    if grp.need is None:
        return None
    if grp.tile_masks is None or grp.tile_masks[2] != torch.device(device):
        bq, bk = plan.block_q, plan.block_k
        ci, cs = grp.need[:, 0], grp.need[:, 1]
        q = grp.qb[ci][:, None, None] * bq + torch.arange(bq)[None, :, None]  # (P, bq, 1)
        kv = grp.slots[ci, cs][:, None, None] * bk + torch.arange(bk)[None, None, :]  # (P, 1, bk)
        b = grp.need_bh[:, 0].view(-1, 1, 1)
        h = grp.need_bh[:, 1].view(-1, 1, 1)
        # padded rows / columns are clamped to real positions (their rows are discarded; their
        # columns are hidden by the range test)
        hidden = torch.zeros(len(grp.qb), bq, grp.k, bk, dtype=torch.bool, device=device)
        step = max(1, CHUNK_ELEMENTS // (bq * bk))  # tiles evaluated at once: bounds the index temporaries
        for t0 in range(0, len(ci), step):
            sl = slice(t0, t0 + step)
            m = mask.evaluate(b[sl].to(device), h[sl].to(device), q[sl].clamp(max=plan.q_len - 1).to(device),
                              kv[sl].clamp(max=plan.kv_len - 1).to(device), plan.q_len, plan.kv_len)
            m = torch.broadcast_to(m, (len(ci[sl]), bq, bk)) & (kv[sl] < plan.kv_len).to(device)
            hidden[ci[sl].to(device), :, cs[sl].to(device), :] = ~m
        dead = hidden.view(len(grp.qb), bq, grp.k * bk).all(-1)  # (n0, bq): rows that see no gathered key
        # additive biases (0 or -inf) of the slot columns that hold partial tiles: adding a float
        # tile is several times faster than masked_fill_ with a bool one
        zero = torch.zeros((), dtype=torch.float32, device=device)
        biases = [(j0, j1, zero.masked_fill(hidden[:, :, j0:j1], float("-inf")))  # (n0, bq, j1 - j0, bk)
                  for j0, j1 in grp.mask_runs]
        grp.tile_masks = (biases, dead if bool(dead.any()) else None, torch.device(device))
    return grp.tile_masks


def _chunks(plan: SparsePlan, grp: _Group):
    """Ranges of compact items per chunk, keeping about CHUNK_ELEMENTS scores in flight."""
    reps, n0 = grp.items.shape
    per_item = reps * plan.rows * grp.k * plan.block_k
    step = max(1, CHUNK_ELEMENTS // per_item)
    for c0 in range(0, n0, step):
        yield c0, min(n0, c0 + step)


def _scores(plan, grp, c0, c1, q_flat, k_flat, scale, mask, device, r0=0, r1=None, bufs=None, kg=None):
    """Masked scores of a chunk ``(r * c, rows, k * block_k)`` (reps ``[r0, r1)`` of compact items
    ``[c0, c1)``), the gathered (scaled) q and k, the index tensors, and the dead-row mask
    ``(r * c, rows, 1)`` or None. ``bufs``: optional flat scratch tensors ``(scores, q, k)``
    reused across chunks (a fresh multi-MiB tensor per chunk costs page faults). ``kg``: the
    keys ``(n, k * block_k, d)`` when the caller has them as a view (no gather)."""
    r1 = grp.items.shape[0] if r1 is None else r1
    items = grp.items[r0:r1, c0:c1].reshape(-1).to(device)  # (n,)
    kv = grp.kv[r0:r1, c0:c1].reshape(-1).to(device)  # (n * k,)
    n = items.numel()
    kr = grp.k * plan.block_k
    if bufs is None:
        qg = q_flat.index_select(0, items).mul_(scale)  # (n, rows, d), scale folded into q
        kg = k_flat.index_select(0, kv).view(n, kr, -1)  # (n, k * bk, d)
        s = torch.bmm(qg, kg.transpose(1, 2))  # (n, rows, k * bk)
    else:
        sbuf, qbuf, kbuf = bufs
        d = q_flat.shape[-1]
        qg = torch.index_select(q_flat, 0, items, out=qbuf[: n * plan.rows * d].view(n, plan.rows, d)).mul_(scale)
        if kg is None:
            kg = torch.index_select(k_flat, 0, kv, out=kbuf[: n * kr * d].view(n * grp.k, plan.block_k, d))
            kg = kg.view(n, kr, d)
        s = torch.bmm(qg, kg.transpose(1, 2), out=sbuf[: n * plan.rows * kr].view(n, plan.rows, kr))
    hid = _hidden(plan, grp, mask, device)
    dead = None
    if hid is not None:
        biases, dead_rows, _ = hid
        reps, gr, bq, bk = r1 - r0, plan.rows // plan.block_q, plan.block_q, plan.block_k
        s6 = s.view(reps, c1 - c0, gr, bq, grp.k, bk)  # (reps, c, G', bq, k, bk)
        for j0, j1, bias in biases:  # only the slot columns that hold partial tiles
            s6[..., j0:j1, :].add_(bias[None, c0:c1, None].to(s.dtype))  # bias (1, c, 1, bq, j1 - j0, bk)
        if dead_rows is not None and bool(dead_rows[c0:c1].any()):
            dead = dead_rows[None, c0:c1, None].expand(reps, -1, gr, -1).reshape(n, plan.rows, 1)
    return s, items, kv, qg, kg, dead


def _to_flat(t: torch.Tensor, plan: SparsePlan, block: int, n_blocks: int) -> torch.Tensor:
    """(B, H, L, D) -> (B * slots * n_blocks, rows, D): one row block per item (zero padded)."""
    B, Hx, L, D = t.shape
    pad = n_blocks * block - L
    if pad:
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
    if plan.head_dependent or Hx == plan.kv_heads:
        return t.reshape(B * Hx * n_blocks, block, D)  # (B*H*nqb, bq, D) or keys (B*Hkv*nkb, bk, D)
    G = plan.group_size
    t = t.view(B, plan.kv_heads, G, n_blocks, block, D).permute(0, 1, 3, 2, 4, 5)  # (B, Hkv, nqb, G, bq, D)
    return t.reshape(B * plan.kv_heads * n_blocks, G * block, D)


def _from_flat(t: torch.Tensor, plan: SparsePlan) -> torch.Tensor:
    """Inverse of :func:`_to_flat` for query-side tensors: -> (B, H, q_len, D)."""
    B, H, nqb, bq, D = plan.batch, plan.heads, plan.n_qb, plan.block_q, t.shape[-1]
    if plan.head_dependent:
        return t.view(B, H, nqb * bq, D)[:, :, : plan.q_len]
    t = t.view(B, plan.kv_heads, nqb, plan.group_size, bq, D).permute(0, 1, 3, 2, 4, 5)  # (B, Hkv, G, nqb, bq, D)
    return t.reshape(B, H, nqb * bq, D)[:, :, : plan.q_len]


# ------------------------------------------------------------------------------------------
# Forward: units in a pool of Python threads
# ------------------------------------------------------------------------------------------

# Scores per forward work unit (2 MiB in float32): a unit is a rectangle of (head copies x
# compact items) of one group, small enough that its score tile stays in a core's cache.
UNIT_ELEMS = 1 << 19
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_THREADED = True  # tests switch it off to compare the threaded forward with the serial one


def _units(plan: SparsePlan) -> list[tuple[_Group, int, int, int, int, tuple | None]]:
    """``(group, c0, c1, r0, r1, view)`` forward work units, the most expensive groups first (so
    that a dynamic schedule ends with the cheap ones); each holds about UNIT_ELEMS scores.
    ``view = (first key block, block step between copies)`` when the unit's key blocks can be
    read as a strided view of the keys (one item whose visited blocks are consecutive, copies
    evenly spaced: sliding windows), else None (gathered). Cached on the plan."""
    if plan.units is not None:
        return plan.units
    units = []
    for grp in sorted(plan.groups, key=lambda g: -g.k):
        reps, n0 = grp.items.shape
        per = plan.rows * grp.k * plan.block_k  # scores of one (copy, item)
        if reps * per <= UNIT_ELEMS:  # whole columns of head copies, several items
            step = max(1, UNIT_ELEMS // (reps * per))
            units += [(grp, c0, min(n0, c0 + step), 0, reps) for c0 in range(0, n0, step)]
        else:  # one item, the head copies split evenly
            parts = -(-reps * per // UNIT_ELEMS)
            rstep = -(-reps // parts)
            units += [(grp, c0, c0 + 1, r0, min(reps, r0 + rstep)) for c0 in range(n0) for r0 in range(0, reps, rstep)]
    out = []
    for grp, c0, c1, r0, r1 in units:
        view = None
        if c1 - c0 == 1:
            starts = grp.kv[r0:r1, c0, 0]
            consecutive = int(grp.slots[c0, -1] - grp.slots[c0, 0]) == grp.k - 1
            step = int(starts[1] - starts[0]) if r1 - r0 > 1 else 0
            if consecutive and step >= 0 and bool((starts.diff() == step).all()):
                view = (int(starts[0]), step)
        out.append((grp, c0, c1, r0, r1, view))
    plan.units = out
    return out


def _run_units(fn, units: list) -> None:
    """Call ``fn(unit)`` for every unit, on all cores (see :mod:`headlab.attention.backends._threads`)."""
    run_units(fn, units, threaded=_THREADED)


def _forward(plan: SparsePlan, mask: MaskFn, q, k, v, scale):
    dev = q.device
    q_flat = _to_flat(q, plan, plan.block_q, plan.n_qb)
    k_flat = _to_flat(k, plan, plan.block_k, plan.n_kb)
    v_flat = _to_flat(v, plan, plan.block_k, plan.n_kb)
    n_items = q_flat.shape[0]
    d, dv = q_flat.shape[-1], v_flat.shape[-1]
    out_flat = q.new_zeros(n_items, plan.rows, dv)
    lse_flat = q.new_full((n_items, plan.rows, 1), float("inf"))  # +inf: the row sees no key
    for grp in plan.groups:
        _hidden(plan, grp, mask, dev)  # evaluate the partial-tile masks here, not in the workers
    units = _units(plan)
    # per-unit sizes: scores, gathered q rows, gathered key (and value) rows
    max_n = max(((c1 - c0) * (r1 - r0) for _, c0, c1, r0, r1, _ in units), default=0)
    max_s = max(((c1 - c0) * (r1 - r0) * g.k for g, c0, c1, r0, r1, _ in units), default=0)
    k2, v2 = k_flat.view(-1, d), v_flat.view(-1, dv)  # (blocks * bk, d): strided views read from here
    scratch: dict[int, tuple] = {}  # per worker thread: (scores, q, k, v, out) flat buffers

    def unit(u) -> None:
        grp, c0, c1, r0, r1, view = u
        kr = grp.k * plan.block_k
        kg = vg = None
        if view is not None:  # consecutive key blocks: (r, k * bk, d) views, no copy
            (start, step), bk = view, plan.block_k
            kg = k2.as_strided((r1 - r0, kr, d), (step * bk * d, d, 1), k2.storage_offset() + start * bk * d)
            vg = v2.as_strided((r1 - r0, kr, dv), (step * bk * dv, dv, 1), v2.storage_offset() + start * bk * dv)
        bufs = scratch.get(threading.get_ident())
        if bufs is None:
            bufs = scratch[threading.get_ident()] = (
                q.new_empty(max_s * plan.rows * plan.block_k), q.new_empty(max_n * plan.rows * d),
                q.new_empty(max_s * plan.block_k * d), q.new_empty(max_s * plan.block_k * dv),
                q.new_empty(max_n * plan.rows * dv))
        # log2(e) folded into the query scale: scores in base 2
        s, items, kv, _, _, dead = _scores(plan, grp, c0, c1, q_flat, k_flat, scale * _LOG2E, mask, dev, r0, r1,
                                           bufs[:3], kg)
        n = len(items)
        m = s.amax(-1, keepdim=True)  # (n, rows, 1), base 2
        if dead is not None:
            m.masked_fill_(dead, 0.0)  # all -inf: exp gives zeros, not NaN
        p = s.sub_(m).exp2_()  # in place: (n, rows, k * bk); exp2 is about twice as fast as exp
        den = p.sum(-1, keepdim=True)
        if vg is None:
            vg = torch.index_select(v_flat, 0, kv, out=bufs[3][: n * kr * dv].view(n * grp.k, plan.block_k, dv))
        if dead is not None:
            den.masked_fill_(dead, 1.0)
        o = torch.bmm(p, vg.view(n, kr, dv), out=bufs[4][: n * plan.rows * dv].view(n, plan.rows, dv)).div_(den)
        lse = m.mul_(_LN2).add_(den.log_())  # natural log-sum-exp
        if dead is not None:
            lse.masked_fill_(dead, float("inf"))  # backward: exp(s - inf) = 0
        out_flat.index_copy_(0, items, o)
        lse_flat.index_copy_(0, items, lse)

    _run_units(unit, units)
    return out_flat, lse_flat


def _backward(plan: SparsePlan, mask: MaskFn, q, k, v, out_flat, lse_flat, dout, scale):
    dev = q.device
    q_flat = _to_flat(q, plan, plan.block_q, plan.n_qb)
    k_flat = _to_flat(k, plan, plan.block_k, plan.n_kb)
    v_flat = _to_flat(v, plan, plan.block_k, plan.n_kb)
    do_flat = _to_flat(dout, plan, plan.block_q, plan.n_qb)
    delta = (do_flat * out_flat).sum(-1, keepdim=True)  # (items, rows, 1): D_i = rowsum(dO * O)
    dq_flat = torch.zeros_like(q_flat)
    dk_flat = torch.zeros_like(k_flat)
    dv_flat = torch.zeros_like(v_flat)
    bk = plan.block_k
    for grp in plan.groups:
        for c0, c1 in _chunks(plan, grp):
            s, items, kv, qg, kg, _ = _scores(plan, grp, c0, c1, q_flat, k_flat, scale, mask, dev)
            n = len(items)
            p = s.sub_(lse_flat.index_select(0, items)).exp_()  # (n, rows, k * bk)
            dog = do_flat.index_select(0, items)  # (n, rows, dv)
            vg = v_flat.index_select(0, kv).view(n, grp.k * bk, -1)
            dv_flat.index_add_(0, kv, torch.bmm(p.transpose(1, 2), dog).view(n * grp.k, bk, -1))
            dp = torch.bmm(dog, vg.transpose(1, 2))  # (n, rows, k * bk)
            ds = p.mul_(dp.sub_(delta.index_select(0, items)))  # dS = P * (dP - D), in place
            dq_flat.index_copy_(0, items, torch.bmm(ds, kg).mul_(scale))
            dk_flat.index_add_(0, kv, torch.bmm(ds.transpose(1, 2), qg).view(n * grp.k, bk, -1))  # qg is scaled
    B, Hkv = plan.batch, plan.kv_heads
    dq = _from_flat(dq_flat, plan)
    dk = dk_flat.view(B, Hkv, plan.n_kb * bk, -1)[:, :, : plan.kv_len]
    dv = dv_flat.view(B, Hkv, plan.n_kb * bk, -1)[:, :, : plan.kv_len]
    return dq, dk, dv


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, mask, scale):
        out_flat, lse_flat = _forward(plan, mask, q, k, v, scale)
        ctx.save_for_backward(q, k, v, out_flat, lse_flat)  # O(n d) + lse: nothing n x n
        ctx.plan, ctx.mask, ctx.scale = plan, mask, scale
        return _from_flat(out_flat, plan)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out_flat, lse_flat = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.plan, ctx.mask, q, k, v, out_flat, lse_flat,
                               dout.to(q.dtype).contiguous(), ctx.scale)
        return dq, dk, dv, None, None, None


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskFn, *,
                     causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Block-sparse exact attention; same conventions as :func:`headlab.attention`.

    Args:
        q: ``(batch, heads, q_len, head_dim)``; k: ``(batch, kv_heads, kv_len, head_dim)``;
            v: ``(batch, kv_heads, kv_len, v_dim)``.
        mask: a :mod:`headlab.masks` function (``None`` allowed when ``causal``).

    Returns ``(batch, heads, q_len, v_dim)`` in q's dtype (float16/bfloat16 compute in float32).
    """
    import headlab

    return headlab.attention(q, k, v, mask=mask, causal=causal, scale=scale, backend="sparse")


def working_set_bytes(spec: AttentionSpec) -> int:
    """Peak extra bytes of one forward call: a few chunk buffers plus O(n d) flat copies."""
    acc = 8 if spec.dtype == torch.float64 else 4
    chunk = 3 * CHUNK_ELEMENTS * acc  # scores/probabilities, gathered K and V (bounded by the chunk)
    flat = spec.batch * (spec.heads * (spec.q_len + BLOCK_Q) * (spec.head_dim + spec.v_dim + 1)
                         + spec.kv_heads * (spec.kv_len + BLOCK_K) * (spec.head_dim + spec.v_dim)) * acc
    return chunk + flat


@register
class SparseBackend(Backend):
    name = "sparse"
    summary = "block-sparse exact attention: visits only non-empty tiles of the mask's block map"
    capabilities = Capabilities(bool_mask=False, dropout=False, returns_weights=False, exact=True,
                                materializes=False)
    priority = 50  # exact, but auto prefers sdpa for dense calls: ask for it by name
    alternative = "sdpa"

    def supports(self, spec: AttentionSpec) -> tuple[bool, str]:
        if spec.mask_kind == "bool":
            return False, ("boolean tensor masks are not supported (pass a headlab.masks function, e.g. "
                           "masks.block_layout(layout, block), so tiles can be skipped)")
        ok, why = super().supports(spec)
        if not ok:
            return ok, why
        if spec.mask_kind != "function" and not spec.causal:
            return False, "needs a mask function or causal=True (without one every tile is visited)"
        return True, ""

    def check_memory(self, spec: AttentionSpec) -> None:
        check_fits(working_set_bytes(spec), what=f"backend 'sparse' at {spec.q_len}x{spec.kv_len}",
                   device=spec.device, alternative="sdpa")

    def forward(self, q, k, v, spec, *, mask, scale):
        eff = effective_mask(mask, spec.causal)
        plan = plan_for(eff, spec.batch, spec.heads, spec.kv_heads, spec.q_len, spec.kv_len)
        dtype = q.dtype
        if dtype in (torch.float16, torch.bfloat16):  # accumulate in float32
            q, k, v = q.float(), k.float(), v.float()
        out = _SparseAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, eff, scale)
        return out.to(dtype), None


__all__ = ["BLOCK_K", "BLOCK_Q", "SparseBackend", "SparsePlan", "block_map", "effective_mask", "plan_for",
           "sparse_attention", "visited_tiles", "working_set_bytes"]
