"""The computations of linear attention: non-causal sums, causal chunked prefix sums, key masks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headlab.errors import BackendUnsupportedError
from headlab.spec.attention_spec import AttentionSpec
from headlab.spec.masks import MaskFn


def exp_minus(x: torch.Tensor, shift: torch.Tensor, hide: torch.Tensor | None = None) -> torch.Tensor:
    """``exp(x - shift)``, 0 where ``hide``; in place when autograd does not need ``x``.

    Hidden entries are set to -inf before ``exp`` (not zeroed after), so a large hidden
    exponent cannot overflow into ``inf * 0 = nan`` in the backward pass."""
    if x.requires_grad or shift.requires_grad:
        y = x - shift
        return torch.exp(y if hide is None else y.masked_fill(hide, float("-inf")))
    x = x.sub_(shift)
    return (x if hide is None else x.masked_fill_(hide, float("-inf"))).exp_()


def _normalise(o: torch.Tensor) -> torch.Tensor:
    """``(..., Dv + 1)`` numerator with the denominator last -> ``(..., Dv)``; 0/0 rows -> 0."""
    num, den = o[..., :-1], o[..., -1:]
    return num / torch.where(den > 0, den, torch.ones_like(den))


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    return torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)  # (B, Hk, Lk, Dv + 1)


def noncausal_sum(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    B, H, Lq, Fn = fq.shape
    Hk = fk.shape[1]
    kv = torch.matmul(fk.transpose(-1, -2), v)  # (B, Hk, F, Dv): the whole state
    z = fk.sum(dim=-2, keepdim=True).transpose(-1, -2)  # (B, Hk, F, 1): the normaliser's state
    fqg = fq.reshape(B, Hk, group * Lq, Fn)  # (B, Hk, G*Lq, F): heads of a group stacked
    num = torch.matmul(fqg, kv).view(B, H, Lq, -1)  # (B, H, Lq, Dv)
    den = torch.matmul(fqg, z).view(B, H, Lq, 1)  # (B, H, Lq, 1)
    den = torch.where(den > 0, den, torch.ones_like(den))  # 0 only when the numerator is 0 too
    return num / den if num.requires_grad else num.div_(den)


def causal_sum(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, group: int, chunk: int) -> torch.Tensor:
    B, H, Lq, Fn = fq.shape
    Hk = fk.shape[1]
    Lk = min(fk.shape[2], Lq)  # top-left causal: keys at positions >= Lq are never visible
    fk = fk[:, :, :Lk]  # (B, Hk, Lk, F)
    v1 = _with_ones(v[:, :, :Lk])  # (B, Hk, Lk, E)
    E = v1.shape[-1]
    C = min(chunk, Lq)
    N = -(-Lq // C)
    L = N * C
    if L > Lq:
        fq = F.pad(fq, (0, 0, 0, L - Lq))  # (B, H, L, F)
    if L > Lk:
        fk = F.pad(fk, (0, 0, 0, L - Lk))  # (B, Hk, L, F): zero features see nothing
        v1 = F.pad(v1, (0, 0, 0, L - Lk))  # (B, Hk, L, E)
    fkc = fk.view(B, Hk, N, C, Fn)  # (B, Hk, N, C, F)
    vc = v1.view(B, Hk, N, C, E)  # (B, Hk, N, C, E)
    chunk_kv = torch.matmul(fkc.transpose(-1, -2), vc)  # (B, Hk, N, F, E): each chunk's state
    prefix = F.pad(chunk_kv.cumsum(dim=2)[:, :, :-1], (0, 0, 0, 0, 1, 0))  # (B, Hk, N, F, E): chunks before
    del chunk_kv
    # the G query heads sharing a kv head are stacked inside each chunk: (B, Hk, N, G*C, F)
    fqc = fq.view(B, Hk, group, N, C, Fn).transpose(2, 3).reshape(B, Hk, N, group * C, Fn)
    out = torch.matmul(fqc, prefix)  # (B, Hk, N, G*C, E): what earlier chunks contribute
    scores = torch.matmul(fqc, fkc.transpose(-1, -2))  # (B, Hk, N, G*C, C)
    tri = torch.ones(C, C, dtype=torch.bool, device=fq.device).tril_().repeat(group, 1)  # (G*C, C)
    scores.masked_fill_(~tri, 0.0)  # in place: matmul's backward does not need its own output
    out = torch.matmul(scores, vc).add_(out)  # (B, Hk, N, G*C, E): plus the masked block of its own chunk
    out = out.view(B, Hk, N, group, C, E).transpose(2, 3).reshape(B, H, L, E)[:, :, :Lq]  # (B, H, Lq, E)
    return _normalise(out)


def key_mask_of(spec: AttentionSpec, mask: torch.Tensor | MaskFn | None) -> torch.Tensor | None:
    """The key padding as ``(Bm, Hm, Lk)`` bool, or None. Refuses masks that depend on the query."""
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        return mask[:, :, 0, :]  # supports() checked: (Bm, Hm, 1, Lk)
    dev = spec.device
    bm = spec.batch if mask.batch_dependent else 1
    hm = spec.heads if mask.head_dependent else 1
    b = torch.arange(bm, device=dev).view(bm, 1, 1, 1)
    h = torch.arange(hm, device=dev).view(1, hm, 1, 1)
    probe = torch.tensor([0, spec.q_len - 1], device=dev).view(1, 1, 2, 1)  # two queries: does it look?
    kv = torch.arange(spec.kv_len, device=dev).view(1, 1, 1, spec.kv_len)
    out = mask.evaluate(b, h, probe, kv, spec.q_len, spec.kv_len)
    out = out.view((1,) * (4 - out.dim()) + tuple(out.shape))
    if out.shape[2] != 1:
        raise BackendUnsupportedError(
            f"backend 'linear' cannot serve this call: mask function {mask.name!r} depends on the query position; "
            "linear attention takes only key padding masks (headlab.masks.padding(lengths), or a boolean mask of "
            "shape (batch, 1, 1, kv_len)) and causal=True; use backend='sdpa' for exact attention with this mask"
        )
    return torch.broadcast_to(out, (out.shape[0], out.shape[1], 1, spec.kv_len))[:, :, 0, :]
