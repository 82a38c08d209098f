"""Method ``"sdpa"`` of :func:`~headlab.attention.stats.attention_stats`: torch's fused CPU flash
kernel and the identities that let it deliver lse, entropy, mean distance and received mass.

Precision: positions ride along as values relative to each query chunk (``j - r0``), so
``mean_distance`` never subtracts two sums of size ``i`` (float32 cancellation cost 1.7e-3 at
4,096 tokens); the docs promise 1e-5 at 16,384 tokens."""

from __future__ import annotations

import torch

from headlab.errors import BackendUnsupportedError
from headlab.spec.attention_spec import AttentionSpec
from headlab.spec.visibility import visible


def _sdpa_ops():
    try:
        return (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
        )
    except (AttributeError, RuntimeError):  # pragma: no cover - depends on the torch build
        raise BackendUnsupportedError(
            f"method='sdpa' needs torch's CPU flash kernel (aten::_scaled_dot_product_flash_attention_for_cpu), "
            f"which torch {torch.__version__} does not provide; use method='tiled'"
        ) from None


# Query rows per kernel call when mean_distance is wanted: positions ride along relative to the
# chunk's first row, so the kernel sums P_ij (j - r0), values within a few chunks of the query.
_POS_CHUNK = 32


def sdpa_stats(q, k, v, spec: AttentionSpec, mask, scale: float, want: set[str], ct: torch.dtype):
    if spec.device.type != "cpu":
        raise BackendUnsupportedError(
            f"method='sdpa' uses torch's CPU flash kernel; tensors are on {spec.device}. Use method='tiled'"
        )
    fwd, bwd = _sdpa_ops()
    B, H, Lq, D = q.shape
    Hkv, G, Lk = spec.kv_heads, spec.group, spec.kv_len
    dev = q.device
    # The kernel needs one head size for q, k and v, so q and k get one zero column and
    # v := [K, positions] rides along with the same width; the explicit scale keeps the scores.
    qp = torch.nn.functional.pad(q.to(ct), (0, 1))  # (B, H, Lq, D+1)
    kx = k.to(ct)
    if G > 1:
        kx = kx[:, :, None].expand(B, Hkv, G, Lk, D).reshape(B, H, Lk, D)  # (B, H, Lk, D): kv head per query head
    kp = torch.nn.functional.pad(kx, (0, 1))  # (B, H, Lk, D+1)
    pos = torch.arange(Lk, device=dev, dtype=ct)
    vp = torch.cat([kx, pos.view(1, 1, Lk, 1).expand(B, H, Lk, 1)], -1)  # (B, H, Lk, D+1): [K, j]
    del kx

    # (Bm, Hm, Lq, Lk) bool, causal included; None without a mask: causal alone is the kernel's is_causal,
    # and building its n x n triangle here would cost what the statistics exist to avoid
    vis = visible(spec, mask) if mask is not None else None
    is_causal = spec.causal and vis is None
    attn_mask = None if vis is None else torch.zeros(vis.shape, dtype=ct, device=dev).masked_fill_(~vis, float("-inf"))
    visible_rows = None if vis is None else vis.any(-1)  # (B?, H?, Lq) bool, None = every row sees a key
    want_md = "mean_distance" in want
    md = None
    if not want_md:
        out, lse = fwd(qp, kp, vp, 0.0, is_causal, attn_mask=attn_mask, scale=scale)  # (B, H, Lq, D+1), (B, H, Lq)
    else:
        out, lse, md = _chunked_with_distance(fwd, qp, kp, vp, pos, vis, spec, scale, ct)
    lse = lse.to(ct)
    visible_ = torch.ones(B, H, Lq, dtype=torch.bool, device=dev)
    if visible_rows is not None:
        visible_ = visible_ & visible_rows
        lse = lse.masked_fill(~visible_, float("-inf"))
    res = {"lse": lse, "visible": visible_}
    if "entropy" in want:
        # H_i = lse_i - scale * q_i . (P K)_i
        ent = lse - scale * (q.to(ct) * out[..., :D]).sum(-1)
        res["entropy"] = ent.masked_fill(~visible_, 0.0)
    if md is not None:
        res["mean_distance"] = md.masked_fill(~visible_, 0.0)
    if "received" in want:
        # sum_i P_ij = d sum(out) / d v_j (any value column): the kernel's fused backward
        ones = torch.ones_like(out)
        lse_k = torch.where(visible_, lse, 0.0).contiguous()
        _gq, _gk, gv = bwd(ones, qp, kp, vp, out.contiguous(), lse_k, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
        res["received"] = gv[..., 0].contiguous()  # (B, H, Lk)
    if v is not None:
        o = torch.nn.functional.scaled_dot_product_attention(
            q.to(ct), k.to(ct), v.to(ct), attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=G > 1
        )
        res["output"] = o.masked_fill(~visible_.unsqueeze(-1), 0.0)
    return res


def _chunked_with_distance(fwd, qp, kp, vp, pos, vis, spec, scale, ct):
    """``out``, ``lse`` and ``mean_distance`` by query chunks of :data:`_POS_CHUNK` rows, the position
    column of V set to ``j - r0`` for the chunk starting at ``r0``::

        sum_j P_ij |i - j| = sum_{j<=i} P_ij ((i - r0) - (j - r0)) + sum_{j>i} P_ij ((j - r0) - (i - r0))

    (one call per chunk when causal; otherwise a second call on keys ``j <= i``, whose lse gives
    the share of the row's mass they hold)."""
    B, H, Lq, Dp = qp.shape
    D, Lk, dev = Dp - 1, spec.kv_len, qp.device
    out = torch.empty(B, H, Lq, Dp, dtype=ct, device=dev)
    lse = torch.empty(B, H, Lq, dtype=ct, device=dev)
    md = torch.empty(B, H, Lq, dtype=ct, device=dev)
    cols = torch.arange(Lk, device=dev)

    def bias(v4):
        return torch.zeros(v4.shape, dtype=ct, device=dev).masked_fill_(~v4, float("-inf"))

    for r0 in range(0, Lq, _POS_CHUNK):
        r1 = min(Lq, r0 + _POS_CHUNK)
        vp[..., D] = pos - r0  # positions relative to the chunk: small values, no cancellation
        rows = torch.arange(r0, r1, device=dev)
        tri = (rows[:, None] >= cols[None, :]).view(1, 1, r1 - r0, Lk)  # keys j <= i
        vis_c = None if vis is None else (vis[:, :, r0:r1] if vis.shape[2] != 1 else vis)  # (Bm, Hm, n or 1, Lk)
        if spec.causal:
            vis_c = tri if vis_c is None else vis_c & tri
        qc = qp[:, :, r0:r1]
        o, l = fwd(qc, kp, vp, 0.0, False, attn_mask=None if vis_c is None else bias(vis_c), scale=scale)
        out[:, :, r0:r1], lse[:, :, r0:r1] = o, l
        qi = (rows - r0).to(ct)  # (n,) query positions relative to the chunk
        ppos = o[..., D]  # sum_j P_ij (j - r0)
        if spec.causal:
            md[:, :, r0:r1] = qi - ppos
            continue
        lo_vis = tri if vis_c is None else vis_c & tri
        o_lo, l_lo = fwd(qc, kp, vp, 0.0, False, attn_mask=bias(lo_vis), scale=scale)
        lo_rows = lo_vis.any(-1)  # (B?, H?, n)
        w_lo = torch.exp(l_lo.to(ct) - torch.where(torch.isfinite(l), l, 0.0).to(ct)).masked_fill_(~lo_rows, 0.0)
        pos_lo = w_lo * o_lo[..., D]  # sum_{j <= i} P_ij (j - r0)
        md[:, :, r0:r1] = (qi * w_lo - pos_lo) + (ppos - pos_lo) - qi * (1 - w_lo)
    vp[..., D] = pos
    return out, lse, md
