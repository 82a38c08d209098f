"""SnapKV's and Ada-KV's group of a :class:`~headlab.decode.cache.HeadCache` layer (Li et al. 2024, Feng et al.
2024): :class:`SnapStore` runs the prefill causal over the whole prompt, then each kv head keeps, in tensors of
its own, the prompt tokens its observation window attends to most (:func:`snap_scores`, :func:`snap_select`) and
every later token. It is the store (``"snap"``) a :class:`~headlab.decode.snap_rule.Snap` rule names;
it registers itself in :data:`headlab.decode.store.STORES`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headlab.decode.expected import Expected, expected_scores, expected_select
from headlab.decode.quant_store import QuantStore
from headlab.decode.rules import Full
from headlab.decode.snap_rule import Snap
from headlab.decode.store import KVStore, register_store
from headlab.errors import InputError


def snap_scores(
    q_win: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    mask: torch.Tensor | None = None,
    pool: int = 7,
    pooling: str = "max",
) -> torch.Tensor:
    """SnapKV's scores of the prompt keys before the observation window (Li et al. 2024), per kv head.

    ``q_win (B, H, w, d)``: the window's queries (the last ``w`` of the prompt), ``H = rep x Hkv`` in kv-head order;
    ``k (B, Hkv, n, d)``: the prompt's keys; ``mask``: which key each window row sees, broadcastable to ``(B, 1,
    w, n)`` (default: causal, row ``i`` sees ``j <= n - w + i``). Each row's softmax runs over every key it sees;
    the score of key ``j < n - w`` is the sum over the rows, pooled along the positions (``pooling`` "max" or
    "avg", width ``pool``, padded, stride 1, per query head), then the mean over a kv head's query heads:
    ``(B, Hkv, n - w)`` float32."""
    B, H, w, d = q_win.shape
    g, n = k.shape[1], k.shape[2]
    rep = H // g
    s = (q_win.float().reshape(B, g, rep * w, d) @ k.float().transpose(-1, -2)).reshape(B, H, w, n)
    s = s * (scale if scale is not None else d**-0.5)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is None:
        mask = torch.arange(n, device=s.device)[None, :] <= torch.arange(n - w, n, device=s.device)[:, None]
    a = torch.softmax(s.masked_fill(~mask.to(s.device), float("-inf")), -1).nan_to_num(0.0)
    votes = a[..., : n - w].sum(-2)  # (B, H, n - w)
    if pool > 1:
        fn = F.max_pool1d if pooling == "max" else F.avg_pool1d
        votes = fn(votes, kernel_size=pool, stride=1, padding=pool // 2)
    return votes.reshape(B, g, rep, n - w).mean(2)


def snap_select(scores: torch.Tensor, rule: Snap, n: int) -> list[torch.Tensor]:
    """The prompt positions each kv head keeps, ascending, given ``scores (heads, n - window)`` of a group under
    ``rule`` and the prompt's length ``n``: SnapKV's top ``budget - window`` per head, or Ada-KV's joint top over
    the heads past each head's floor; the window's ``n - window .. n - 1`` always."""
    heads, L = scores.shape[0], n - rule.window
    window = torch.arange(L, n)
    if rule.adaptive:
        total = rule.group_total(heads)
        if total >= heads * n:
            return [torch.arange(n)] * heads
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # ties: the earlier position
        chosen = torch.zeros(heads, L, dtype=torch.bool)
        floor = min(rule.floor_for(heads) - rule.window, L)
        chosen.scatter_(1, order[:, :floor], True)
        rest = total - heads * (rule.window + floor)
        cand = (~chosen).flatten().nonzero().squeeze(1)  # head-major: ties go to the lower head, earlier position
        top = cand[torch.sort(scores.flatten()[cand], descending=True, stable=True).indices[:rest]]
        chosen.view(-1)[top] = True
        return [torch.cat([chosen[h].nonzero().squeeze(1), window]) for h in range(heads)]
    assert rule.budget is not None  # not adaptive: SnapKV's fixed budget
    if rule.budget >= n:
        return [torch.arange(n)] * heads
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : rule.budget - rule.window]
    return [torch.cat([order[h].sort().values, window]) for h in range(heads)]


@register_store
class SnapStore(KVStore):
    """The kv heads of one layer that share a SnapKV or Ada-KV rule.

    The prefill runs causal over the whole prompt; then each head keeps the prompt tokens its observation window
    attends to most (:func:`snap_scores`, :func:`snap_select`) and the window, in its own tensors ``(B, 1, kept,
    d)``: an Ada-KV head's count is its own. Every later token is appended to every head; a decode step attends to
    all a head holds.

    A quantized rule (``bits`` 8, 4, 2) holds each head's tokens in a :class:`~headlab.decode.quant_store.QuantStore`
    of its own under ``kv.full(bits)``, whose positions are the head's held tokens counted in order (``0, 1, ...``;
    the real ones stay in ``pos``): KIVI's storage of that sequence, and a decode step on the codes."""

    name = "snap"
    rule: Snap
    keys: list[torch.Tensor] | None  # per head
    values: list[torch.Tensor] | None
    pos: list[torch.Tensor] | None
    prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    quant: list[QuantStore] | None  # a quantized rule's heads, each in a store of its own
    codes = True  # a quantized head's decode step attends on its codes (HeadCache(codes=...))
    rotary = None  # the model's rotary embedding (Expected Attention un-rotates the queries with it): HeadCache sets it

    def reset(self) -> None:
        self.keys = self.values = self.pos = None  # per head: (B, 1, kept, d), (B, 1, kept, dv), (kept,)
        self.prompt = None  # (keys, values, positions) of the prefill, before selection
        self.quant = None

    def _tensors(self):
        """Everything held: the prompt (keys, values, positions) until the selection; then each head's keys and
        values (or its quantized store's tensors) and the int64 positions of what it kept."""
        if self.prompt is not None:
            return list(self.prompt)
        pos = [] if self.pos is None else list(self.pos)
        if self.quant is not None:
            return [t for qs in self.quant for t in qs._tensors() if t is not None] + pos
        return [] if self.keys is None else self.keys + self.values + pos

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @property
    def v_dim(self) -> int | None:  # type: ignore[override]  # from what it holds: a property over the base's None
        if self.quant is not None:
            return self.quant[0].v_dim if self.quant else None
        if self.prompt is not None:
            return self.prompt[1].shape[-1]
        return self.values[-1].shape[-1] if self.values else None

    @property
    def budgets(self) -> list[int] | None:
        """Tokens each kv head holds (after the prefill: the prompt tokens it kept), or None before."""
        return None if self.pos is None else [p.numel() for p in self.pos]

    def positions(self) -> list[torch.Tensor]:
        if self.prompt is not None:
            return [self.prompt[2]] * len(self.kv)
        return [torch.zeros(0, dtype=torch.long)] * len(self.kv) if self.pos is None else list(self.pos)

    def append(self, k: torch.Tensor, v: torch.Tensor, new_pos: torch.Tensor) -> None:
        if self.quant is not None:
            assert self.pos is not None  # selected at the prefill
            for i, qs in enumerate(self.quant):
                n = self.pos[i].numel()
                qs.append(k[:, i : i + 1], v[:, i : i + 1], torch.arange(n, n + k.shape[2]))
                self.pos[i] = torch.cat([self.pos[i], new_pos])
            return
        if self.keys is None:
            if self.prompt is not None:
                raise AssertionError("headlab: a SnapKV group took two chunks before its prefill's attention")
            self.prompt = (k, v, new_pos.clone())
            return
        assert self.values is not None and self.pos is not None  # held with the keys
        for i in range(len(self.keys)):
            self.keys[i] = torch.cat([self.keys[i], k[:, i : i + 1]], 2)
            self.values[i] = torch.cat([self.values[i], v[:, i : i + 1]], 2)
            self.pos[i] = torch.cat([self.pos[i], new_pos])

    def attend(self, attention, q, q_pos: torch.Tensor, hf, scaling, softcap, *, fresh: bool) -> torch.Tensor:
        """The group's query heads ``q (B, heads, m, d)``: the prefill (then the selection), or a later chunk."""
        m, rep = q.shape[2], self.rep
        if self.prompt is not None:
            k, v, pos = self.prompt  # in a storage dtype of its own (HeadCache(dtype=...)): computed in the query's
            k, v = k.to(q.dtype), v.to(q.dtype)
            vis = None
            if hf is None:
                o = attention(q, k, v, causal=True, scale=scaling)
            else:
                vis = (pos[None, :] <= q_pos[:, None]).to(q.device) & hf.index_select(-1, pos.to(hf.device))
                o = attention(q, k, v, mask=vis, scale=scaling)
            self._select(q, k, v, pos, vis, scaling, softcap)
            return o
        outs = []
        if self.quant is not None:
            assert self.pos is not None  # selected at the prefill
            for i, (qs, pos) in enumerate(zip(self.quant, self.pos)):
                n = pos.numel()  # the query chunk is the last m held: positions n - m .. n - 1 in the head's order
                own_hf = None if hf is None else hf.index_select(-1, pos.to(hf.device))
                qi = q[:, i * rep : (i + 1) * rep]
                outs.append(qs.attend(attention, qi, torch.arange(n - m, n), own_hf, scaling, softcap, fresh=False))
            return torch.cat(outs, 1)
        assert self.keys is not None and self.values is not None and self.pos is not None  # selected at the prefill
        for i, (k, v, pos) in enumerate(zip(self.keys, self.values, self.pos)):
            qi = q[:, i * rep : (i + 1) * rep]
            k, v = k.to(q.dtype), v.to(q.dtype)
            if m == 1 and hf is None:  # every held key is visible to the newest query
                if softcap is None:
                    outs.append(F.scaled_dot_product_attention(qi, k, v, scale=scaling, enable_gqa=True))
                else:
                    outs.append(attention(qi, k, v, scale=scaling))
                continue
            vis = (pos[None, :] <= q_pos[:, None]).to(q.device)
            if hf is not None:
                vis = vis & hf.index_select(-1, pos.to(hf.device))
            outs.append(attention(qi, k, v, mask=vis, scale=scaling))
        return torch.cat(outs, 1)

    def _select(self, q, k, v, pos, vis, scaling, softcap) -> None:
        r, n = self.rule, k.shape[2]
        if isinstance(r, Expected):
            if n <= r.sink:
                raise InputError(f"{r!r}: the prompt has {n} tokens, no more than its {r.sink} sinks")
            scores = expected_scores(q, k, v, pos, r, scale=scaling, rotary=self.rotary)[0].cpu()
            self._keep(k, v, pos, expected_select(scores, r, n))
            return
        if r.window > n:
            raise InputError(
                f"{r!r}: the observation window is {r.window} tokens but the prompt has {n}: give a "
                f"prompt of at least {r.window} tokens, or a smaller window (window={max(1, n // 4)})"
            )
        heads = k.shape[1]
        keep_all = (r.group_total(heads) >= heads * n) if r.adaptive else r.budget >= n
        if keep_all:
            idx = [torch.arange(n)] * heads
        else:
            rows = None if vis is None else vis[..., n - r.window :, :]
            scores = snap_scores(
                q[:, :, n - r.window :], k, scale=scaling, softcap=softcap, mask=rows, pool=r.pool, pooling=r.pooling
            )[0].cpu()  # (heads, n - window): one sequence
            idx = snap_select(scores, r, n)
        self._keep(k, v, pos, idx)

    def _keep(self, k, v, pos, idx: list[torch.Tensor]) -> None:
        """Hold the prompt tokens ``idx`` (per head) of the prefill's keys and values, as the rule stores them (as
        the prompt was held: in the storage dtype when one is set, a quantized head's scales and zero points too)."""
        r = self.rule
        if self.prompt is not None:  # the tensors held, not the copy in the query's dtype that scored them
            k, v = self.prompt[0], self.prompt[1]
        self.keys = [k[:, i : i + 1].index_select(2, j.to(k.device)).contiguous() for i, j in enumerate(idx)]
        self.values = [v[:, i : i + 1].index_select(2, j.to(v.device)).contiguous() for i, j in enumerate(idx)]
        self.pos = [pos[j] for j in idx]
        self.prompt = None
        if r.bits != 16:  # each head's kept tokens, in order, stored as KIVI stores a sequence
            self.quant = []
            for kk, vv in zip(self.keys, self.values):
                qs = QuantStore(Full(r.bits, r.group, r.residual), [0], self.rep, 1)
                qs.codes = self.codes
                qs.append(kk, vv, torch.arange(kk.shape[2]))
                qs.flush(kk.shape[2])
                self.quant.append(qs)
            self.keys = self.values = None
