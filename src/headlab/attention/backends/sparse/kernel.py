"""The block-sparse forward (units in a pool of Python threads) and backward, and the autograd
function joining them. Natural-log units throughout: the backward recomputes ``P = exp(S - lse)``
from the same scaled query as the forward (a base-2 forward with a base-e lse cost float32
gradients up to 10x their plain error at large logits)."""

from __future__ import annotations

import threading

import torch

from headlab.attention.backends import _threads, native
from headlab.attention.backends.sparse.plan import SparsePlan, TileGroup
from headlab.attention.backends.sparse.tiles import from_flat, group_chunks, hidden_cells, tile_scores, to_flat
from headlab.spec.masks import MaskFn

# Scores per forward work unit (2 MiB in float32): a unit is a rectangle of (head copies x
# compact items) of one group, small enough that its score tile stays in a core's cache.
UNIT_ELEMS = 1 << 19


def _units(plan: SparsePlan) -> list[tuple[TileGroup, int, int, int, int, tuple | None]]:
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


def _forward(plan: SparsePlan, mask: MaskFn, q, k, v, scale, score_mod=None):
    dev = q.device
    q_flat = to_flat(q, plan, plan.block_q, plan.n_qb)
    k_flat = to_flat(k, plan, plan.block_k, plan.n_kb)
    v_flat = to_flat(v, plan, plan.block_k, plan.n_kb)
    n_items = q_flat.shape[0]
    d, dv = q_flat.shape[-1], v_flat.shape[-1]
    out_flat = q.new_zeros(n_items, plan.rows, dv)
    ml_flat = q.new_zeros(n_items, plan.rows, 2)  # per row [m, log l]; lse = m + log l
    ml_flat[..., 1] = float("inf")  # log l = +inf: the row sees no key
    for grp in plan.groups:
        hidden_cells(plan, grp, mask, dev)  # evaluate the partial-tile masks here, not in the workers
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
                q.new_empty(max_s * plan.rows * plan.block_k),
                q.new_empty(max_n * plan.rows * d),
                q.new_empty(max_s * plan.block_k * d),
                q.new_empty(max_s * plan.block_k * dv),
                q.new_empty(max_n * plan.rows * dv),
            )
        s, items, kv, _, _, hidden_rows = tile_scores(
            plan, grp, c0, c1, q_flat, k_flat, scale, mask, dev, r0, r1, bufs[:3], kg, score_mod=score_mod
        )
        n = len(items)
        m = s.amax(-1, keepdim=True)  # (n, rows, 1)
        m.masked_fill_(torch.isneginf(m), 0.0)  # a row that sees no key: exp gives zeros, not NaN
        p = s.sub_(m).exp_()  # in place: (n, rows, k * bk)
        den = p.sum(-1, keepdim=True)
        if vg is None:
            vg = torch.index_select(v_flat, 0, kv, out=bufs[3][: n * kr * dv].view(n * grp.k, plan.block_k, dv))
        dead = den == 0  # (n, rows, 1): rows that see no key (a NaN row is not dead: NaN propagates)
        if hidden_rows is not None:  # rows the mask hides entirely, also when a NaN sits under the mask
            dead |= hidden_rows
            p.masked_fill_(hidden_rows, 0.0)
            m.masked_fill_(hidden_rows, 0.0)
        den.masked_fill_(dead, 1.0)
        o = torch.bmm(p, vg.view(n, kr, dv), out=bufs[4][: n * plan.rows * dv].view(n, plan.rows, dv)).div_(den)
        logl = den.log_().masked_fill_(dead, float("inf"))  # backward: exp(s - m - inf) = 0
        out_flat.index_copy_(0, items, o)
        ml_flat.index_copy_(0, items, torch.cat([m, logl], -1))

    _threads.run_units(unit, units)
    return out_flat, ml_flat


def _backward(plan: SparsePlan, mask: MaskFn, q, k, v, out_flat, ml_flat, dout, scale, score_mod=None, params=()):
    """Each item's gathered keys are every key its rows see, so ``D = rowsum(P * dP)`` is taken
    from the chunk itself (the softmax's own backward), and ``P = exp((S - m) - log l)`` from the
    forward's shift ``m`` and ``log l`` (``S - m`` is exact near the maximum). Also returns the
    gradients of the score_mod's trainable ``params`` (a list, None where one got none)."""
    pgrads = [None] * len(params)
    dev = q.device
    q_flat = to_flat(q, plan, plan.block_q, plan.n_qb)
    k_flat = to_flat(k, plan, plan.block_k, plan.n_kb)
    v_flat = to_flat(v, plan, plan.block_k, plan.n_kb)
    do_flat = to_flat(dout, plan, plan.block_q, plan.n_qb)
    dq_flat = torch.zeros_like(q_flat)
    dk_flat = torch.zeros_like(k_flat)
    dv_flat = torch.zeros_like(v_flat)
    bk = plan.block_k
    for grp in plan.groups:
        for c0, c1 in group_chunks(plan, grp):
            s, items, kv, qg, kg, _, back = tile_scores(
                plan,
                grp,
                c0,
                c1,
                q_flat,
                k_flat,
                scale,
                mask,
                dev,
                score_mod=score_mod,
                vjp=True,
                params=params,
                grads=pgrads,
            )
            n = len(items)
            ml = ml_flat.index_select(0, items)  # (n, rows, 2)
            p = s.sub_(ml[..., :1]).sub_(ml[..., 1:]).exp_()  # (n, rows, k * bk)
            dog = do_flat.index_select(0, items)  # (n, rows, dv)
            vg = v_flat.index_select(0, kv).view(n, grp.k * bk, -1)
            dv_flat.index_add_(0, kv, torch.bmm(p.transpose(1, 2), dog).view(n * grp.k, bk, -1))
            dp = torch.bmm(dog, vg.transpose(1, 2))  # (n, rows, k * bk)
            delta = (p * dp).sum(-1, keepdim=True)  # (n, rows, 1): D = rowsum(P * dP)
            ds = p.mul_(dp.sub_(delta))  # dS = P * (dP - D), in place
            if back is not None:
                ds = back(ds)  # through the score_mod
            dq_flat.index_copy_(0, items, torch.bmm(ds, kg).mul_(scale))
            dk_flat.index_add_(0, kv, torch.bmm(ds.transpose(1, 2), qg).view(n * grp.k, bk, -1))  # qg is scaled
    B, Hkv = plan.batch, plan.kv_heads
    dq = from_flat(dq_flat, plan)
    dk = dk_flat.view(B, Hkv, plan.n_kb * bk, -1)[:, :, : plan.kv_len]
    dv = dv_flat.view(B, Hkv, plan.n_kb * bk, -1)[:, :, : plan.kv_len]
    return dq, dk, dv, pgrads


class SparseAttention(torch.autograd.Function):
    """Saves q, k, v and the per-row shift and log-normaliser: O(n d), nothing n x n. Returns the output
    ``(B, H, Lq, Dv)`` and the lse ``(B, H, Lq)`` (``+-inf`` on rows that see no key). On the compiled
    kernel (:mod:`headlab.attention.backends.native`) when it takes the call (a mask that is one band
    of offsets: windows, causal, their compositions), in its own layout; else on the flat items above."""

    @staticmethod
    def forward(ctx, q, k, v, plan, mask, scale, score_mod, spec=None, *params):
        ctx.native = spec is not None and native.declines(spec, mask, q.dtype, score_mod=score_mod) is None
        ctx.plan, ctx.mask, ctx.scale, ctx.score_mod, ctx.spec = plan, mask, scale, score_mod, spec
        ctx.params = params  # the score_mod's trainable tensors (their gradients are returned)
        if ctx.native:
            fwd = native.forward(q, k, v, mask, scale, causal=spec.causal)  # (B, H, Lq, .)
            ctx.save_for_backward(q, k, v, fwd.out, fwd.m, fwd.log_l)
            out, lse = fwd.out, fwd.lse
        else:
            out_flat, ml_flat = _forward(plan, mask, q, k, v, scale, score_mod)
            ctx.save_for_backward(q, k, v, ml_flat)
            out = from_flat(out_flat, plan)
            lse = from_flat(ml_flat[..., :1] + ml_flat[..., 1:], plan).squeeze(-1)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if ctx.native:  # the compiled kernel's own backward, from the same m and log l
            q, k, v, out, m, log_l = ctx.saved_tensors
            dq, dk, dv = native.backward(q, k, v, dout, m, log_l, ctx.mask, ctx.scale, causal=ctx.spec.causal, out=out)
            return (dq, dk, dv, None, None, None, None, None, *([None] * len(ctx.params)))
        q, k, v, ml_flat = ctx.saved_tensors
        dq, dk, dv, pgrads = _backward(
            ctx.plan,
            ctx.mask,
            q,
            k,
            v,
            None,
            ml_flat,
            dout.to(q.dtype).contiguous(),
            ctx.scale,
            ctx.score_mod,
            ctx.params,
        )
        pg = tuple(None if g is None else g.to(t.dtype) for g, t in zip(pgrads, ctx.params))
        return (dq, dk, dv, None, None, None, None, None, *pg)
