"""The tiled backward pass and the autograd function that joins it to the forward.

Per tile, from q, k, v, the saved output ``O`` and log-sum-exp (natural log, from the same
scaled query as the forward)::

    S  = scale q k^T  (then score_mod, then the mask)      P  = exp((S - m) - log l)
    dV += P^T dO                                           dP - D = [dO | -D] @ [V | 1]^T
    dS = P * (dP - D),  D = rowsum(dO * O)  (O unrounded, in the compute dtype)
    dS_raw = dS * d score_mod / d S   (autograd through the score_mod, when there is one)
    dQ += dS_raw K * scale                                 dK += dS_raw^T (scale q)

``(S - m) - log l`` are separate subtractions, not an extra matmul column: the shift stays out of
the dot product's accumulation, and ``S - m`` is exact for the scores near the maximum (the lse
rounded once as ``m + log l`` would cost ``eps * |lse|`` on every probability). When one tile
holds a row's every key, ``D = rowsum(P * dP)`` is taken from that tile (the softmax's own form).
"""

from __future__ import annotations

import torch

from headlab.attention.backends import native
from headlab.attention.backends.tiled.forward import forward
from headlab.attention.backends.tiled.plan import (
    BLOCK_K,
    BLOCK_Q,
    Plan,
    from_rows,
    index_grid,
    mask_tile,
    prepare_kv,
    scaled_query,
    to_rows,
)
from headlab.spec.score_mods import param_vjp
from headlab.spec.tile_states import EMPTY, PARTIAL


def _score_mod_vjp(p: Plan, s_raw, i0, i1, j0, j1, params=(), grads=None):
    """``(score_mod(s_raw), vjp)``, where ``vjp(ds)`` gives ``ds * d score_mod / d s_raw`` and, for
    the score_mod's trainable tensors ``params``, adds ``ds``'s vector-Jacobian product to ``grads``."""
    b, h, qi, kv = index_grid(p, i0, i1, j0, j1, 0, s_raw.shape[0], s_raw.device)
    assert p.score_mod is not None  # called only for a plan with a score_mod
    if not params and getattr(p.score_mod, "additive", False):  # score + bias: the derivative is 1
        return p.score_mod(s_raw, b, h, qi, kv), lambda ds: ds
    return param_vjp(p.score_mod, s_raw, (b, h, qi, kv), params, grads)


def backward(q, k, v, out, ml, dout, p: Plan, params=()):
    """Gradients ``dq (B, H, Lq, D)``, ``dk (B, Hkv, Lk, D)``, ``dv (B, Hkv, Lk, Dv)`` from the
    forward's ``ml (BHkv, Lq*G, 2)`` = ``[m, log l]``, and those of the score_mod's trainable
    ``params`` (a list, None where a tensor got no gradient)."""
    pgrads = [None] * len(params)
    qs = scaled_query(q, p)  # (BHkv, Lq*G, D+1): [scale q | 0], rounded as in the forward
    kt, vaug = prepare_kv(k, v, p)
    BHkv, Dv = p.B * p.Hkv, p.Dv
    do = to_rows(dout, p).to(p.cdtype)  # (BHkv, Lq*G, Dv)
    # dO augmented with -D, D = rowsum(dO * O): then [dO | -D] @ [V | 1]^T = dO V^T - D
    doaug = torch.empty(BHkv, p.Lq * p.G, Dv + 1, dtype=p.cdtype, device=q.device)
    doaug[..., :Dv] = do
    doaug[..., Dv] = -(do * out).sum(-1)
    m_all, logl_all = ml[..., :1], ml[..., 1:]  # (BHkv, Lq*G, 1) each; log l = +inf: the row sees no key
    dq = torch.zeros(BHkv, p.Lq * p.G, p.D, dtype=p.cdtype, device=q.device)
    dk = torch.zeros(BHkv, p.Lk, p.D, dtype=p.cdtype, device=q.device)
    dv = torch.zeros(BHkv, p.Lk, Dv, dtype=p.cdtype, device=q.device)
    k_rows = kt[:, : p.D].transpose(1, 2)  # (BHkv, Lk, D)
    keep_scale = 1.0 / (1.0 - p.dropout_p) if p.dropout_p > 0 else 1.0
    for qb in range(p.n_qb):
        i0, i1 = p.q_rows(qb)
        r0, r1 = i0 * p.G, i1 * p.G
        qb_rows, do_b, doaug_b = qs[:, r0:r1], do[:, r0:r1], doaug[:, r0:r1]
        m_b, logl_b = m_all[:, r0:r1], logl_all[:, r0:r1]
        # one visited tile holds the whole row: D = rowsum(P * dP) from the tile itself, as the
        # softmax's own backward computes it (exact zero gradient for a row that sees one key)
        single = sum(1 for st in p.states[qb] if st != EMPTY) == 1 and p.dropout_p == 0
        if single:
            doaug_b = doaug_b.clone()
            doaug_b[..., Dv] = 0.0
        qb_scaled = qb_rows[..., : p.D]  # (BHkv, r, D): scale * q
        dq_b = dq[:, r0:r1]
        for kb, state in enumerate(p.states[qb]):
            if state == EMPTY:
                continue
            j0, j1 = p.k_cols(kb, i1)
            s = torch.bmm(qb_rows, kt[:, :, j0:j1])  # (BHkv, r, c) = scale q k^T
            vjp = None
            if p.score_mod is not None:
                s, vjp = _score_mod_vjp(p, s, i0, i1, j0, j1, params, pgrads)
            if state == PARTIAL:
                mask_tile(s, p, i0, i1, j0, j1)
            prob = s.sub_(m_b).sub_(logl_b).exp_()  # P = exp((S - m) - log l): S - m exact near the max
            if p.dropout_p > 0:
                keep = p.keep(qb, kb, prob.shape, prob.device)
                dv[:, j0:j1].baddbmm_(prob.masked_fill(~keep, 0.0).transpose(1, 2), do_b, alpha=keep_scale)
                ds = torch.bmm(do_b, vaug[:, j0:j1, :Dv].transpose(1, 2))  # dO V^T
                ds.masked_fill_(~keep, 0.0).mul_(keep_scale).add_(doaug_b[..., Dv:]).mul_(prob)
            else:
                dv[:, j0:j1].baddbmm_(prob.transpose(1, 2), do_b)  # dV += P^T dO
                ds = torch.bmm(doaug_b, vaug[:, j0:j1].transpose(1, 2))  # dO V^T - D
                if single:
                    ds.sub_((ds * prob).sum(-1, keepdim=True))  # D = rowsum(P * dP)
                ds.mul_(prob)  # dS = P * (dP - D)
            if vjp is not None:
                ds = vjp(ds)
            dq_b.baddbmm_(ds, k_rows[:, j0:j1])  # dQ += dS K   (scale applied at the end)
            dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), qb_scaled)  # dK += dS^T (scale Q)
            del s, prob, ds
    dq.mul_(p.scale)
    return from_rows(dq, p), dk.view(p.B, p.Hkv, p.Lk, p.D), dv.view(p.B, p.Hkv, p.Lk, Dv), pgrads


def native_declines(p: Plan) -> str | None:
    """Why the compiled kernel (:mod:`headlab.attention.backends.native`) does not take this call, or None."""
    return native.declines(
        p.spec,
        p.mask,
        p.cdtype,
        dropout_p=p.dropout_p,
        score_mod=p.score_mod,
        own_tiles=(p.block_q, p.block_k) != (BLOCK_Q, BLOCK_K),
    )


class TiledAttention(torch.autograd.Function):
    """Saves q, k, v, the output and the per-row ``m`` and ``log l``: O(n) memory, nothing n x n. Returns
    the output ``(B, H, Lq, Dv)`` in q's dtype and the lse ``(B, H, Lq)`` (``+-inf`` on rows that see no key).
    On the compiled kernel when it takes the call (its own layout and statistics), else on the
    PyTorch kernels above (rows ``(B*Hkv, Lq*G, .)``)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: Plan, *params):
        ctx.native = native_declines(plan) is None
        ctx.plan, ctx.params = plan, params  # the score_mod's trainable tensors (their gradients are returned)
        if ctx.native:
            fwd = native.forward(q, k, v, plan.mask, plan.scale, causal=plan.spec.causal)  # (B, H, Lq, .)
            ctx.save_for_backward(q, k, v, fwd.out, fwd.m, fwd.log_l)
            out, lse = fwd.out, fwd.lse
        else:
            out_rows, ml = forward(q, k, v, plan)  # (BHkv, Lq*G, Dv), (BHkv, Lq*G, 2)
            ctx.save_for_backward(q, k, v, out_rows, ml)
            out, lse = from_rows(out_rows, plan), from_rows(ml[..., :1] + ml[..., 1:], plan).squeeze(-1)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        p = ctx.plan
        pgrads = [None] * len(ctx.params)
        if ctx.native:  # the compiled kernel's own backward, from the same m and log l
            q, k, v, out, m, log_l = ctx.saved_tensors
            dq, dk, dv = native.backward(q, k, v, dout, m, log_l, p.mask, p.scale, causal=p.spec.causal, out=out)
        else:
            q, k, v, out, ml = ctx.saved_tensors
            dq, dk, dv, pgrads = backward(q, k, v, out, ml, dout, p, ctx.params)
        pg = tuple(None if g is None else g.to(t.dtype) for g, t in zip(pgrads, ctx.params))
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, *pg)
