"""The per-token Gram matrices behind every norm map (Kobayashi et al. 2020, 2021).

Head h's transformed value of token j is ``f_h(x_j) = (x_j W_V^{kv(h)} + b_V^{kv(h)}) W_O^h`` (``E``
wide; GQA: kv(h) = h // (H // Hkv); no output bias). The layer map needs
``||sum_h alpha^h_ij f_h(x_j)||^2 = sum_{h,h'} alpha^h_ij alpha^h'_ij G_j[h, h']`` with the Gram
matrix ``G_j[h, h'] = <f_h(x_j), f_h'(x_j)>`` ``(n, H, H)``: ``O(n H^2)`` numbers instead of the
``H x n x n x E`` tensor of the vectors themselves.

Residual mode (Kobayashi et al. 2021) decomposes what the block writes for token i into one vector
per input token j, ``F_i(x_j) = g_i(sum_h alpha^h_ij f_h(x_j) + [i = j] r_i)``, where

* post-LN blocks (BERT): ``r_i`` is the layer input x_i (the residual) and ``g_i`` the LayerNorm's
  linear part ``g_i(v) = gamma * (v - mean(v)) / s_i``, with ``s_i = sqrt(var(z_i) + eps)`` the
  standard deviation of the LayerNorm's actual input ``z_i`` held fixed (as in the paper). Left
  out, as a token-independent term: ``g_i(b_O) + beta``. So ``sum_j F_i(x_j) + g_i(b_O) + beta`` is
  exactly the LayerNorm's output.
* pre-norm blocks (GPT-2, Llama, headlab): the norm *makes* the attention's input
  ``x~ = norm(x)``; ``r_i`` is the un-normalised residual stream x_i and ``g_i`` the identity, so
  ``sum_j F_i(x_j) + b_O = x_i + Attn(x~)_i``, the block's residual stream after attention.
* sandwich blocks (Gemma 2 and 3, OLMo 2): the post norm reads the attention's output alone and the
  block adds the stream after it, so ``F_i(x_j) = g_i(sum_h alpha^h_ij f_h(x_j)) + [i = j] x_i`` with
  ``g_i`` the post norm's linear part (scale ``offset + w``, ``s_i`` from its actual input
  ``Attn(x)_i + b_O``); ``sum_j F_i(x_j) + g_i(b_O) (+ beta)`` is the stream after attention. The cross
  terms carry the metric once and ``s_i`` once: they are stored times ``s_i`` (and ``||r_i||^2`` times
  ``s_i^2``) so that the same ``sqrt(.) / s_i`` gives the norm.
* parallel blocks (GPT-J, GPT-NeoX, Phi, Falcon): ``x + Attn(pre(x)) + MLP(pre'(x))``; the MLP's
  output depends on token i alone, so it joins the residual: ``r_i = x_i + MLP_i`` and
  ``sum_j F_i(x_j) + b_O`` is the block's output.
* a scaled residual branch (Granite's ``residual_multiplier`` m, LayerScale's vector lambda: DINOv2, BEiT):
  the block reads ``lambda * Attn(x)`` where the layouts above read ``Attn(x)``, so each ``f_h(x_j)`` is
  ``lambda * f_h(x_j)`` (and ``b_O`` is ``lambda * b_O``) in residual mode; attention mode stays the
  attention's own output.

Norms of ``g_i(v)`` use the metric ``M = C diag(gamma^2) C`` (C centres the vector): the Gram
matrices, the cross terms ``c_i[h] = <f_h(x_i), r_i>_M`` and ``||r_i||_M^2`` carry it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headlab.models.tp_weights import value_path

_CHUNK = 2048  # tokens per chunk when forming the (H, chunk, E) value vectors


@dataclass
class NormGram:
    w: torch.Tensor  # (H, n): ||f_h(x_j)||_M, the per-head value norms
    G: torch.Tensor  # (n, H, H): Gram matrices under the metric
    inv_s: torch.Tensor  # (n,): 1 / s_i of each query; a 0-dim 1 without a post norm (every query alike)
    cross: torch.Tensor | None = None  # (n, H): <f_h(x_i), r_i>_M      [residual mode]
    rr: torch.Tensor | None = None  # (n,): ||r_i||_M^2                  [residual mode]


def value_vectors(adapter, layer: int, x: torch.Tensor, weights=None) -> torch.Tensor:
    """``f_h(x_j)`` for every head: ``(H, n, E)`` (use only for short inputs or chunks). ``weights``: the layer's
    :func:`~headlab.models.tp_weights.value_path`, when the caller has it already (read once per layer: on a
    model sharded by tensor parallelism it is gathered, every head in global order)."""
    WV, bV, WO = weights if weights is not None else value_path(adapter, layer)  # (Hkv, E, d), (Hkv, d), (H, d, E)
    G = adapter.n_heads // adapter.n_kv_heads
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = torch.einsum("ne,ked->knd", x.to(ct), WV.to(ct))  # (Hkv, n, d)
    if bV is not None:
        v = v + bV.to(ct).unsqueeze(1)
    v = v.repeat_interleave(G, dim=0)  # (H, n, d)
    return torch.einsum("hnd,hde->hne", v, WO.to(ct))  # (H, n, E)


def _metric_fn(norms):
    """v -> (offset + gamma) * (v - mean v) for a post norm (no centring for RMSNorm); identity without one."""
    if norms is None or norms.post is None:
        return lambda v: v

    def g0(v):
        v = v - v.mean(-1, keepdim=True) if norms.kind == "layernorm" else v
        gamma = norms.scale(v.dtype)
        return v * gamma if gamma is not None else v

    return g0


def gram(adapter, layer: int, rec, mode: str) -> NormGram:
    """The :class:`NormGram` of one layer from its :class:`~headlab.interpret.flow.record.LayerRecord`."""
    x = rec.x
    n = x.shape[0]
    residual = mode == "residual"
    g0 = _metric_fn(rec.norms if residual else None)
    branch = residual and rec.norms.post is not None and rec.norms.post_reads == "branch"
    ws, Gs, cs, rrs = [], [], [], []
    weights = value_path(adapter, layer)  # once per layer (a gather under tensor parallelism)
    # a scaled residual branch (LayerScale, a residual multiplier) scales each head's vector where the block reads it
    scaled = rec.norms.branch if residual and rec.norms.branch_scale is not None else (lambda f: f)
    for a in range(0, n, _CHUNK):
        f = g0(scaled(value_vectors(adapter, layer, x[a : a + _CHUNK], weights)))  # (H, c, E)
        Gs.append(torch.einsum("hne,kne->nhk", f, f))  # (c, H, H)
        ws.append(f.norm(dim=-1))  # (H, c)
        if residual:
            r = rec.resid[a : a + _CHUNK].to(f.dtype)  # (c, E)
            r = r if branch else g0(r)  # a sandwich block adds the stream after its post norm
            cs.append(torch.einsum("hne,ne->nh", f, r))
            rrs.append((r * r).sum(-1))
    ct = Gs[0].dtype
    inv_s = torch.ones((), dtype=ct, device=x.device)  # queries need not be x's rows (cross-attention)
    cross = torch.cat(cs, 0) if residual else None
    rr = torch.cat(rrs, 0) if residual else None
    if residual and rec.norms.post is not None:
        z = rec.norm_in.to(ct)
        var = z.var(-1, unbiased=False) if rec.norms.kind == "layernorm" else (z * z).mean(-1)
        inv_s = torch.rsqrt(var + rec.norms.eps())
        if branch:  # ||g_i(a) + r||^2 = (||a||_M^2 + 2 s <a, r>_g + s^2 ||r||^2) / s^2
            assert cross is not None and rr is not None  # residual
            s = 1.0 / inv_s
            cross, rr = cross * s.unsqueeze(1), rr * s * s
    return NormGram(torch.cat(ws, 1), torch.cat(Gs, 0), inv_s, cross, rr)


def layer_tile(p: torch.Tensor, qpos: torch.Tensor, c0: int, c1: int, ng: NormGram) -> torch.Tensor:
    """The layer norm map on one tile: ``(bq, bk)`` from the probabilities ``p (H, bq, bk)`` of the
    queries at positions ``qpos (bq,)`` and keys ``c0:c1``."""
    Gk = ng.G[c0:c1].to(p.dtype)  # (bk, H, H)
    n2 = torch.einsum("hij,jhk,kij->ij", p, Gk, p)  # (bq, bk)
    if ng.cross is not None:
        eq = qpos.view(-1, 1) == torch.arange(c0, c1, device=p.device).view(1, -1)
        ii, jj = eq.nonzero(as_tuple=True)
        if ii.numel():
            pos = qpos[ii]
            assert ng.rr is not None  # held with cross
            n2[ii, jj] += 2 * (p[:, ii, jj] * ng.cross[pos].T.to(p.dtype)).sum(0) + ng.rr[pos].to(p.dtype)
    return n2.clamp_min_(0).sqrt_() * _inv_s(ng, qpos, p.dtype).unsqueeze(1)


def head_tile(p: torch.Tensor, qpos: torch.Tensor, c0: int, c1: int, ng: NormGram) -> torch.Tensor:
    """Per-head norms ``||alpha^h_ij g_i(f_h(x_j))||`` on one tile: ``(H, bq, bk)``."""
    return p * ng.w[:, c0:c1].to(p.dtype).unsqueeze(1) * _inv_s(ng, qpos, p.dtype).view(1, -1, 1)


def _inv_s(ng: NormGram, qpos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``1 / s_i`` of the queries at ``qpos``: ``(bq,)``."""
    inv = ng.inv_s.to(dtype)
    return inv.expand(qpos.shape[0]) if inv.dim() == 0 else inv[qpos]


__all__ = ["NormGram", "gram", "head_tile", "layer_tile", "value_vectors"]
