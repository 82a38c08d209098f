"""The element-wise work of the block-sparse kernel: partial-tile biases, the gathered scores of a
chunk (with a score_mod when there is one), and the flat row layouts."""

from __future__ import annotations

import torch

from headlab.attention.backends.sparse.plan import SparsePlan, TileGroup
from headlab.spec.masks import MaskFn
from headlab.spec.score_mods import param_vjp
from headlab.spec.visibility import pairs

# Score entries computed at once (per chunk); bounds the working set to a few such buffers.
CHUNK_ELEMENTS = 1 << 20


def hidden_cells(plan: SparsePlan, grp: TileGroup, mask: MaskFn, device):
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
        assert grp.need_bh is not None  # set with need, by the plan
        b = grp.need_bh[:, 0].view(-1, 1, 1)
        h = grp.need_bh[:, 1].view(-1, 1, 1)
        # padded rows / columns: the visibility module clamps rows and hides columns past the end
        hidden = torch.zeros(len(grp.qb), bq, grp.k, bk, dtype=torch.bool, device=device)
        step = max(1, CHUNK_ELEMENTS // (bq * bk))  # tiles evaluated at once: bounds the index temporaries
        for t0 in range(0, len(ci), step):
            sl = slice(t0, t0 + step)
            m = pairs(
                mask, b[sl].to(device), h[sl].to(device), q[sl].to(device), kv[sl].to(device), plan.q_len, plan.kv_len
            )
            hidden[ci[sl].to(device), :, cs[sl].to(device), :] = ~torch.broadcast_to(m, (len(ci[sl]), bq, bk))
        dead = hidden.view(len(grp.qb), bq, grp.k * bk).all(-1)  # (n0, bq): rows that see no gathered key
        # additive biases (0 or -inf) of the slot columns that hold partial tiles: adding a float
        # tile is several times faster than masked_fill_ with a bool one
        zero = torch.zeros((), dtype=torch.float32, device=device)
        biases = [
            (j0, j1, zero.masked_fill(hidden[:, :, j0:j1], float("-inf")))  # (n0, bq, j1 - j0, bk)
            for j0, j1 in grp.mask_runs
        ]
        grp.tile_masks = (biases, dead if bool(dead.any()) else None, torch.device(device))
    return grp.tile_masks


def group_chunks(plan: SparsePlan, grp: TileGroup):
    """Ranges of compact items per chunk, keeping about CHUNK_ELEMENTS scores in flight."""
    reps, n0 = grp.items.shape
    per_item = reps * plan.rows * grp.k * plan.block_k
    step = max(1, CHUNK_ELEMENTS // per_item)
    for c0 in range(0, n0, step):
        yield c0, min(n0, c0 + step)


def score_index(plan: SparsePlan, items: torch.Tensor, kv: torch.Tensor, k: int):
    """FlexAttention's ``(b, h, q_idx, kv_idx)`` of gathered items: ``b, h, q_idx`` ``(n, rows, 1)``,
    ``kv_idx`` ``(n, 1, k * block_k)`` (padding positions point past the sequence; they are hidden)."""
    bq, bk, nqb, nkb, Hs = plan.block_q, plan.block_k, plan.n_qb, plan.n_kb, plan.head_slots
    n = items.numel()
    b = (items // (Hs * nqb)).view(n, 1, 1)
    hs = ((items // nqb) % Hs).view(n, 1, 1)
    qb = (items % nqb).view(n, 1, 1)
    r = torch.arange(plan.rows, device=items.device).view(1, -1, 1)
    if plan.head_dependent:
        h, qi = hs.expand(n, plan.rows, 1), qb * bq + r
    else:  # rows = (group member g, position in block)
        h, qi = hs * plan.group_size + r // bq, qb * bq + r % bq
    kvi = ((kv % nkb).view(n, k, 1) * bk + torch.arange(bk, device=kv.device).view(1, 1, bk)).view(n, 1, k * bk)
    return b.expand(n, plan.rows, 1), h, qi, kvi


def tile_scores(
    plan,
    grp,
    c0,
    c1,
    q_flat,
    k_flat,
    scale,
    mask,
    device,
    r0=0,
    r1=None,
    bufs=None,
    kg=None,
    score_mod=None,
    vjp=False,
    params=(),
    grads=None,
):
    """Masked scores of a chunk ``(r * c, rows, k * block_k)`` (reps ``[r0, r1)`` of compact items
    ``[c0, c1)``), the gathered (scaled) q and k, the index tensors, the dead-row mask
    ``(r * c, rows, 1)`` or None, and (with ``vjp``) a function ``ds -> ds * d score_mod / d s``.
    ``bufs``: optional flat scratch tensors ``(scores, q, k)`` reused across chunks (a fresh
    multi-MiB tensor per chunk costs page faults). ``kg``: the keys ``(n, k * block_k, d)`` when
    the caller has them as a view (no gather). ``score_mod`` is applied before the mask; with ``vjp``
    and trainable ``params``, the backward function also adds their gradients to ``grads``."""
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
    back = None
    if score_mod is not None:
        b, h, qi, kvi = score_index(plan, items, kv, grp.k)
        if not vjp or (not params and getattr(score_mod, "additive", False)):
            s = score_mod(s, b, h, qi, kvi).contiguous()
            back = (lambda ds: ds) if vjp else None
        else:  # through autograd; the score_mod's trainable tensors get their gradients in grads
            s, back = param_vjp(score_mod, s, (b, h, qi, kvi), params, grads)
            s = s.contiguous()
    hid = hidden_cells(plan, grp, mask, device)
    dead = None
    if hid is not None:
        biases, dead_rows, _ = hid
        reps, gr, bq, bk = r1 - r0, plan.rows // plan.block_q, plan.block_q, plan.block_k
        s6 = s.view(reps, c1 - c0, gr, bq, grp.k, bk)  # (reps, c, G', bq, k, bk)
        for j0, j1, bias in biases:  # only the slot columns that hold partial tiles
            s6[..., j0:j1, :].add_(bias[None, c0:c1, None].to(s.dtype))  # bias (1, c, 1, bq, j1 - j0, bk)
        if dead_rows is not None and bool(dead_rows[c0:c1].any()):
            dead = dead_rows[None, c0:c1, None].expand(reps, -1, gr, -1).reshape(n, plan.rows, 1)
    if vjp:
        return s, items, kv, qg, kg, dead, back
    return s, items, kv, qg, kg, dead


def to_flat(t: torch.Tensor, plan: SparsePlan, block: int, n_blocks: int) -> torch.Tensor:
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


def from_flat(t: torch.Tensor, plan: SparsePlan) -> torch.Tensor:
    """Inverse of :func:`to_flat` for query-side tensors: -> (B, H, q_len, D)."""
    B, H, nqb, bq, D = plan.batch, plan.heads, plan.n_qb, plan.block_q, t.shape[-1]
    if plan.head_dependent:
        return t.view(B, H, nqb * bq, D)[:, :, : plan.q_len]
    t = t.view(B, plan.kv_heads, nqb, plan.group_size, bq, D).permute(0, 1, 3, 2, 4, 5)  # (B, Hkv, G, nqb, bq, D)
    return t.reshape(B, H, nqb * bq, D)[:, :, : plan.q_len]
