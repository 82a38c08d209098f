"""The exact entries both methods share: scores and probabilities of chosen queries / keys
(``key_mass``, ``rows``), from the final log-sum-exp."""

from __future__ import annotations

import torch

from headlab.spec.attention_spec import AttentionSpec
from headlab.spec.visibility import visible


def _scores_at(
    q: torch.Tensor,
    k: torch.Tensor,
    spec: AttentionSpec,
    scale: float,
    ct: torch.dtype,
    q_idx: torch.Tensor | None,
    kv_idx: torch.Tensor | None,
) -> torch.Tensor:
    """Scores ``q_i . k_j * scale`` for chosen queries and/or keys: (B, H, R, M) in ``ct``."""
    B, H, Hkv, G = spec.batch, spec.heads, spec.kv_heads, spec.group
    qs = q if q_idx is None else q[:, :, q_idx]  # (B, H, R, D)
    R = qs.shape[2]
    if kv_idx is None:
        ks = k  # (B, Hkv, Lk, D)
    elif kv_idx.dim() == 2:  # per batch (B, M)
        ks = torch.gather(k, 2, kv_idx.view(B, 1, -1, 1).expand(B, Hkv, kv_idx.shape[1], k.shape[-1]))
    else:
        ks = k[:, :, kv_idx]  # (B, Hkv, M, D)
    qg = qs.to(ct).reshape(B, Hkv, G * R, -1)  # (B, Hkv, G*R, D): heads sharing a kv head stacked
    s = torch.matmul(qg, ks.to(ct).transpose(-1, -2))  # (B, Hkv, G*R, M)
    return s.view(B, H, R, -1).mul_(scale)  # (B, H, R, M)


def probs_at(q, k, spec, mask, scale, ct, lse, q_idx, kv_idx, score_mod=None) -> torch.Tensor:
    """Exact ``P_ij`` for the chosen queries / keys from the final ``lse``: (B, H, R, M)."""
    s = _scores_at(q, k, spec, scale, ct, q_idx, kv_idx)
    if score_mod is not None:
        B, H, R, M = s.shape
        dev = s.device
        qi = (torch.arange(R, device=dev) if q_idx is None else q_idx.to(dev)).view(1, 1, R, 1)
        if kv_idx is None:
            kv = torch.arange(M, device=dev).view(1, 1, 1, M)
        elif kv_idx.dim() == 2:  # per batch (B, M)
            kv = kv_idx.to(dev).view(B, 1, 1, M)
        else:
            kv = kv_idx.to(dev).view(1, 1, 1, M)
        s = score_mod(
            s, torch.arange(B, device=dev).view(B, 1, 1, 1), torch.arange(H, device=dev).view(1, H, 1, 1), qi, kv
        )
    vis = visible(spec, mask, q_idx, kv_idx)
    l_sel = lse if q_idx is None else lse[:, :, q_idx]  # (B, H, R)
    dead = torch.isneginf(l_sel).unsqueeze(-1)
    p = torch.exp(s - torch.where(dead, 0.0, l_sel.unsqueeze(-1)))
    if vis is not None:
        p = p.masked_fill(~vis, 0.0)
    return p.masked_fill(dead, 0.0)
