"""A KV cache shaped per head, as a transformers ``Cache``: each kv head holds only what its rule keeps.

:class:`HeadCache` plugs into Hugging Face generation (``model.generate(..., cache=HeadCache(model,
policy))``) and into :func:`headlab.generate`. Per layer, the kv heads are split into **groups** that
share a rule: one tensor pair ``(B, heads in group, kept, d)`` per group, so a windowed head holds
``sink + recent`` keys and a dropped head none; the bytes are real (``nbytes`` of the tensors).

How it reaches attention: ``update`` returns a :class:`GroupedKV` in place of the key tensor; the
attention implementation ``"headlab"`` (which the cache switches the model to) sees it and calls
:meth:`GroupedKV.headlab_attend`, which runs each group's query heads on that group's keys:

- a prefill (queries from an empty cache) of a windowed group runs its band ``0 <= query - key < recent``
  on the ``sparse`` backend (only the window's tiles) and its sinks apart, merged by log-sum-exp
  (:func:`window_prefill`); the full groups run causal on ``auto``;
- a decode step evicts first (keys no longer visible to the new query), then attends to all that is held;
- dropped groups' query heads output zeros.

Keys keep their original positions (rotary embeddings are applied before caching), so a decode under
the policy equals one forward with the policy's visibility (:meth:`headlab.kv.Policy.visible`).

A group whose rule is quantized (``bits`` 8, 4, 2) or compensated is held by :class:`_QGroup` (the plain
groups above are untouched, bit for bit): keys and values as KIVI stores them (Liu et al. 2024; codes,
scales and zero points, :mod:`headlab.decode.quant`, with the most recent tokens in full precision),
read back for each step's attention; a compensated window keeps the mean of what it evicted as one more
key/value pair, weighted by the count it stands for (Tang et al. 2024, RazorAttention).

A group under a SnapKV or Ada-KV rule is held by :class:`_SnapGroup`: its prefill runs causal over the whole
prompt, then each kv head keeps, in tensors of its own, the prompt tokens its observation window attends to
most (:func:`snap_scores`, :func:`snap_select`; Li et al. 2024, Feng et al. 2024) and every later token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from headlab.attention import masks
from headlab.attention.core import attention as _attention
from headlab.attention.score_mods import softcap as _softcap
from headlab.decode import quant
from headlab.decode.kv import (Drop, Full, Policy, Rule, Snap, Window, check_decoder, key_boundary, kv_layout,
                               value_boundary, visibility)
from headlab.errors import ConfigError, InputError, ShapeError

__all__ = ["HeadCache", "HeadLayer", "GroupedKV"]

SPARSE_PREFILL = 128  # below this many queries the window's tiles are too few for the sparse kernel to pay


class _Group:
    """The kv heads of one layer that share a rule, and the keys they hold."""

    def __init__(self, rule: Rule, kv_heads: list[int], rep: int, n_kv: int):
        self.rule = rule
        self.whole = len(kv_heads) == n_kv  # the layer's only group: no gathering of heads
        self.kv = torch.tensor(kv_heads, dtype=torch.long)
        # query head h reads kv head h // rep: the group's query heads, in the order of its kv heads
        self.q = torch.tensor([j * rep + r for j in kv_heads for r in range(rep)], dtype=torch.long)
        self.keys = self.values = None       # (B, heads, kept, d)
        self.pos = torch.zeros(0, dtype=torch.long)  # positions of the held keys
        self.ring = rule.sink if isinstance(rule, Window) else 0  # the slot of the oldest key past the sinks

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    @property
    def v_dim(self) -> int | None:
        return self.values.shape[-1] if self.values is not None else None

    def reset(self) -> None:
        self.keys = self.values = None
        self.pos = torch.zeros(0, dtype=torch.long)
        self.ring = self.rule.sink if isinstance(self.rule, Window) else 0

    def append(self, k: torch.Tensor, v: torch.Tensor, new_pos: torch.Tensor) -> None:
        """Add ``(B, heads, m, d)`` keys and values at positions ``new_pos``.

        A windowed group that already holds ``sink + recent`` keys takes one new key in place: it
        overwrites the oldest key past the sinks (the one the new query no longer sees), so a decode
        step copies nothing. Everything else is appended (and evicted after the attention)."""
        r = self.rule
        if (isinstance(r, Window) and k.shape[2] == 1 and self.keys is not None
                and self.pos.numel() == r.sink + r.recent):
            if r.recent == 0:  # only the sinks are ever visible: the new key is never read
                return
            slot = self.ring
            self.keys[:, :, slot] = k[:, :, 0]
            self.values[:, :, slot] = v[:, :, 0]
            self.pos[slot] = new_pos[0]
            self.ring = r.sink + (slot - r.sink + 1) % r.recent
        elif self.keys is None:
            self.keys, self.values, self.pos = k.contiguous(), v.contiguous(), new_pos.clone()
        else:
            self.keys, self.values = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
            self.pos = torch.cat([self.pos, new_pos])

    def evict(self, last: int) -> None:
        """Keep what a query at position ``last`` may see (windowed groups), in position order."""
        r = self.rule
        if not isinstance(r, Window) or self.keys is None or self.pos.numel() <= r.sink + r.recent:
            return
        keep = (self.pos < r.sink) | (last - self.pos < r.recent)
        idx = keep.nonzero().squeeze(1)
        idx = idx[self.pos[idx].argsort()]
        self.keys = self.keys.index_select(2, idx.to(self.keys.device)).contiguous()
        self.values = self.values.index_select(2, idx.to(self.values.device)).contiguous()
        self.pos = self.pos[idx]
        self.ring = r.sink


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=2)


def _rows(t: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(2, idx.to(t.device))


_NO_POS = torch.zeros(0, dtype=torch.long)


class _QGroup:
    """The kv heads of one layer that share a quantized or compensated rule.

    Held, in position order: the sinks (a window's first keys, full precision); the quantized keys (packed
    codes, and per key group of ``rule.group`` tokens a scale and a zero point per channel) and values (codes,
    and per token a scale and zero per ``rule.group`` channels); the full-precision residuals (keys from
    :func:`~headlab.kv.key_boundary`, values from :func:`~headlab.kv.value_boundary` on); and, compensated,
    the mean of the evicted keys and values with their count. A window evicts before quantizing, so a key
    group that had lost tokens to the window takes its scale from the tokens it still holds.
    """

    def __init__(self, rule: Rule, kv_heads: list[int], rep: int, n_kv: int):
        self.rule, self.rep = rule, rep
        self.whole = len(kv_heads) == n_kv
        self.kv = torch.tensor(kv_heads, dtype=torch.long)
        self.q = torch.tensor([j * rep + r for j in kv_heads for r in range(rep)], dtype=torch.long)
        self.start = rule.sink if isinstance(rule, Window) else 0
        self.compensate = bool(getattr(rule, "compensate", False))
        self.reset()

    def reset(self) -> None:
        self.sink_k = self.sink_v = None
        self.sink_pos = _NO_POS
        self.kq = self.ks = self.kz = None     # codes (B, h, t, d*bits/8); scale, zero (B, h, groups, d)
        self.kq_pos, self.k_gid = _NO_POS, _NO_POS
        self.kr, self.kr_pos = None, _NO_POS    # full-precision keys past the key boundary
        self.vq = self.vs = self.vz = None     # codes (B, h, t, dv*bits/8); scale, zero (B, h, t, dv/group)
        self.vq_pos = _NO_POS
        self.vr, self.vr_pos = None, _NO_POS    # full-precision values past the value boundary
        self.comp_k = self.comp_v = None       # (B, h, 1, d): the mean of the evicted keys and values
        self.comp_n = 0

    def _tensors(self):
        return (self.sink_k, self.sink_v, self.kq, self.ks, self.kz, self.kr, self.vq, self.vs, self.vz, self.vr,
                self.comp_k, self.comp_v)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors() if t is not None)

    @property
    def v_dim(self) -> int | None:
        v = self.sink_v if self.sink_v is not None else self.vr if self.vr is not None else self.vs
        if v is None:
            return None
        return v.shape[-1] if v is not self.vs else v.shape[-1] * self.rule.group

    # -- storing -------------------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, new_pos: torch.Tensor) -> None:
        self.dtype = k.dtype
        i = max(0, min(k.shape[2], self.start - int(new_pos[0])))  # how many of the new tokens are sinks
        if i:
            self.sink_k, self.sink_v = _cat(self.sink_k, k[:, :, :i]), _cat(self.sink_v, v[:, :, :i])
            self.sink_pos = torch.cat([self.sink_pos, new_pos[:i]])
        if i < k.shape[2]:
            self.kr, self.vr = _cat(self.kr, k[:, :, i:]), _cat(self.vr, v[:, :, i:])
            self.kr_pos = torch.cat([self.kr_pos, new_pos[i:]])
            self.vr_pos = torch.cat([self.vr_pos, new_pos[i:]])

    def _key_scales(self, pos: torch.Tensor) -> torch.Tensor:
        """The scale row of each quantized key at ``pos``."""
        gid = torch.div(pos - self.start, self.rule.group, rounding_mode="floor")
        return torch.searchsorted(self.k_gid, gid)

    def _keys(self, idx: torch.Tensor | None = None) -> torch.Tensor | None:
        """The quantized keys read back (rows ``idx``, or all)."""
        if self.kq is None:
            return None
        pos = self.kq_pos if idx is None else self.kq_pos[idx]
        codes = self.kq if idx is None else _rows(self.kq, idx)
        rows = self._key_scales(pos).to(self.ks.device)
        return quant.dequantize_keys(codes, self.ks.index_select(2, rows), self.kz.index_select(2, rows),
                                     bits=self.rule.bits)

    def _values(self, idx: torch.Tensor | None = None) -> torch.Tensor | None:
        if self.vq is None:
            return None
        if idx is None:
            return quant.dequantize_values(self.vq, self.vs, self.vz, bits=self.rule.bits)
        return quant.dequantize_values(_rows(self.vq, idx), _rows(self.vs, idx), _rows(self.vz, idx),
                                       bits=self.rule.bits)

    def evict(self, last: int) -> None:
        """Drop what a query at ``last`` no longer sees (windows); compensated, fold it into the mean."""
        r = self.rule
        if not isinstance(r, Window):
            return
        cut = last - r.recent  # positions <= cut past the sinks are gone
        sums: dict[str, list[torch.Tensor]] = {"k": [], "v": []}
        gone = 0
        for name in ("kq", "kr", "vq", "vr"):
            pos = getattr(self, f"{name}_pos")
            if pos.numel() == 0 or int(pos[0]) > cut:
                continue
            drop = int(torch.searchsorted(pos, torch.tensor(cut), right=True))
            if self.compensate:
                idx = torch.arange(drop)
                t = (self._keys(idx) if name == "kq" else self._values(idx) if name == "vq"
                     else _rows(getattr(self, name), idx))
                sums[name[0]].append(t.float().sum(2, keepdim=True))
                gone += drop if name[0] == "k" else 0
            keep = torch.arange(drop, pos.numel())
            setattr(self, f"{name}_pos", pos[drop:])
            setattr(self, name, _rows(getattr(self, name), keep))
            if name == "kq":
                if self.kq_pos.numel() == 0:
                    self.kq = self.ks = self.kz = None
                    self.k_gid = _NO_POS
                else:  # the groups that still hold a key keep their scales
                    first = int(self._key_scales(self.kq_pos[:1])[0])
                    rows = torch.arange(first, self.k_gid.numel())
                    self.ks, self.kz, self.k_gid = _rows(self.ks, rows), _rows(self.kz, rows), self.k_gid[first:]
            elif name == "vq":
                if self.vq_pos.numel() == 0:
                    self.vq = self.vs = self.vz = None
                else:
                    self.vs, self.vz = _rows(self.vs, keep), _rows(self.vz, keep)
        if gone:
            sk, sv, n = sum(sums["k"]), sum(sums["v"]), self.comp_n
            if self.comp_k is not None:
                sk, sv = sk + self.comp_k.float() * n, sv + self.comp_v.float() * n
            self.comp_k, self.comp_v = (sk / (n + gone)).to(self.dtype), (sv / (n + gone)).to(self.dtype)
            self.comp_n = n + gone

    def flush(self, tokens: int) -> None:
        """Quantize what has passed the boundaries once ``tokens`` tokens are cached (KIVI)."""
        r = self.rule
        if r.bits == 16:
            return
        bk = key_boundary(r, tokens)
        if self.kr is not None and self.kr_pos.numel() and int(self.kr_pos[0]) < bk:
            m = int(torch.searchsorted(self.kr_pos, torch.tensor(bk)))
            x, pos = self.kr[:, :, :m], self.kr_pos[:m]
            gid = torch.div(pos - self.start, r.group, rounding_mode="floor")
            head = int((gid == gid[0]).sum())  # the first group may have lost tokens to a window
            parts = [(x[:, :, :head], head)] + ([(x[:, :, head:], r.group)] if head < m else [])
            for xs, g in parts:
                codes, sc, ze = quant.quantize_keys(xs, r.bits, g)
                self.kq, self.ks, self.kz = _cat(self.kq, codes), _cat(self.ks, sc), _cat(self.kz, ze)
            self.k_gid = torch.cat([self.k_gid, torch.unique_consecutive(gid)])
            self.kq_pos = torch.cat([self.kq_pos, pos])
            self.kr, self.kr_pos = (self.kr[:, :, m:] if m < self.kr_pos.numel() else None), self.kr_pos[m:]
        bv = value_boundary(r, tokens)
        if self.vr is not None and self.vr_pos.numel() and int(self.vr_pos[0]) < bv:
            m = int(torch.searchsorted(self.vr_pos, torch.tensor(bv)))
            codes, sc, ze = quant.quantize_values(self.vr[:, :, :m], r.bits, r.group)
            self.vq, self.vs, self.vz = _cat(self.vq, codes), _cat(self.vs, sc), _cat(self.vz, ze)
            self.vq_pos = torch.cat([self.vq_pos, self.vr_pos[:m]])
            self.vr, self.vr_pos = (self.vr[:, :, m:] if m < self.vr_pos.numel() else None), self.vr_pos[m:]

    def held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(keys, values, positions, sinks)``: everything held, read back in full precision, in position order."""
        ks = [t for t in (self.sink_k, self._keys(), self.kr) if t is not None]
        vs = [t for t in (self.sink_v, self._values(), self.vr) if t is not None]
        pos = torch.cat([self.sink_pos, self.kq_pos, self.kr_pos])
        if not torch.equal(pos, torch.cat([self.sink_pos, self.vq_pos, self.vr_pos])):
            raise AssertionError("headlab: a quantized kv group holds keys and values of different positions")
        return torch.cat(ks, 2), torch.cat(vs, 2), pos, self.sink_pos.numel()

    # -- attending -----------------------------------------------------------------------------------------
    def attend(self, attention, q, q_pos: torch.Tensor, hf, scaling, softcap, *, fresh: bool) -> torch.Tensor:
        """The group's query heads ``q (B, heads, m, d)`` on what it holds; stores, evicts and quantizes."""
        m = q.shape[2]
        last = int(q_pos[-1])
        if m == 1:  # KIVI: the new token enters the cache (and the residual is quantized) before it attends
            self._step(last)
        k, v, pos, n_sink = self.held()
        need = self.compensate
        if m == 1 and hf is None and not need:
            if softcap is None:
                o, lse = F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True), None
            else:
                o, lse = attention(q, k, v, scale=scaling), None
        elif m == 1 and hf is None:
            o, lse = attention(q, k, v, scale=scaling, return_lse=True)
        elif fresh and hf is None and isinstance(self.rule, Full):
            o, lse = _split(attention(q, k, v, causal=True, scale=scaling, return_lse=need), need)
        elif fresh and hf is None:
            o, lse = _split(window_prefill(attention, q, k, v, self.rule, scaling, return_lse=need,
                                           backend="sparse" if m >= SPARSE_PREFILL else "auto"), need)
        else:
            vis = visibility(self.rule, q_pos[:, None], pos[None, :]).to(q.device)
            if hf is not None:
                vis = vis & hf.index_select(-1, pos.to(hf.device))
            o, lse = _split(attention(q, k, v, mask=vis, scale=scaling, return_lse=need), need)
        if need:
            o = self._compensated(o, lse, q, q_pos, k[:, :, n_sink:], v[:, :, n_sink:], pos[n_sink:], scaling, softcap)
        if m > 1:
            self._step(last)
        return o

    def _step(self, last: int) -> None:
        self.evict(last)
        self.flush(last + 1)

    def _compensated(self, o, lse, q, q_pos, k_past, v_past, pos_past, scaling, softcap) -> torch.Tensor:
        """Merge RazorAttention's compensation token into ``o``: for query ``t``, the mean of the keys and values
        evicted before it (those already folded, and held ones past the sinks with ``t - j >= recent``), its
        score raised by the log of their count (the token stands for that many)."""
        m = q.shape[2]
        if m == 1:
            n_t = torch.full((1,), self.comp_n, dtype=torch.float32)
            if self.comp_n == 0:
                return o
            ck, cv = self.comp_k.float(), self.comp_v.float()  # (B, h, 1, d)
        else:
            cut = (q_pos - self.rule.recent).to(pos_past.device)
            c = torch.searchsorted(pos_past, cut, right=True)  # held past-sink keys each query no longer sees
            zeros_k = k_past.new_zeros(*k_past.shape[:2], 1, k_past.shape[-1], dtype=torch.float32)
            zeros_v = v_past.new_zeros(*v_past.shape[:2], 1, v_past.shape[-1], dtype=torch.float32)
            sk = torch.cat([zeros_k, k_past.float().cumsum(2)], 2).index_select(2, c.to(k_past.device))
            sv = torch.cat([zeros_v, v_past.float().cumsum(2)], 2).index_select(2, c.to(v_past.device))
            n_t = (c + self.comp_n).float()
            if self.comp_n:
                sk = sk + self.comp_k.float() * self.comp_n
                sv = sv + self.comp_v.float() * self.comp_n
            div = n_t.clamp(min=1).to(sk.device)[None, None, :, None]
            ck, cv = sk / div, sv / div  # (B, h, m, d)
        ck, cv = ck.repeat_interleave(self.rep, 1), cv.repeat_interleave(self.rep, 1)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        s = (q.float() * ck).sum(-1) * scale  # (B, H, m)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s + torch.log(n_t).to(s.device)  # -inf where nothing was evicted
        lse = lse.float()
        total = torch.logaddexp(lse, s)
        w1 = torch.exp(lse - total).nan_to_num(0.0).unsqueeze(-1)
        w2 = torch.exp(s - total).nan_to_num(0.0).unsqueeze(-1)
        return (o.float() * w1 + cv * w2).to(o.dtype)


def snap_scores(q_win: torch.Tensor, k: torch.Tensor, *, scale: float | None = None, softcap: float | None = None,
                mask: torch.Tensor | None = None, pool: int = 7, pooling: str = "max") -> torch.Tensor:
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
    s = s * (scale if scale is not None else d ** -0.5)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is None:
        mask = torch.arange(n, device=s.device)[None, :] <= torch.arange(n - w, n, device=s.device)[:, None]
    a = torch.softmax(s.masked_fill(~mask.to(s.device), float("-inf")), -1).nan_to_num(0.0)
    votes = a[..., :n - w].sum(-2)  # (B, H, n - w)
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
    if rule.budget >= n:
        return [torch.arange(n)] * heads
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :rule.budget - rule.window]
    return [torch.cat([order[h].sort().values, window]) for h in range(heads)]


class _SnapGroup:
    """The kv heads of one layer that share a SnapKV or Ada-KV rule.

    The prefill runs causal over the whole prompt; then each head keeps the prompt tokens its observation window
    attends to most (:func:`snap_scores`, :func:`snap_select`) and the window, in its own tensors ``(B, 1, kept,
    d)``: an Ada-KV head's count is its own. Every later token is appended to every head; a decode step attends to
    all a head holds."""

    def __init__(self, rule: Snap, kv_heads: list[int], rep: int, n_kv: int):
        self.rule, self.rep = rule, rep
        self.whole = len(kv_heads) == n_kv
        self.kv = torch.tensor(kv_heads, dtype=torch.long)
        self.q = torch.tensor([j * rep + r for j in kv_heads for r in range(rep)], dtype=torch.long)
        self.reset()

    def reset(self) -> None:
        self.keys = self.values = self.pos = None  # per head: (B, 1, kept, d), (B, 1, kept, dv), (kept,)
        self.prompt = None                         # (keys, values, positions) of the prefill, before selection

    def _tensors(self):
        if self.prompt is not None:
            return list(self.prompt[:2])
        return [] if self.keys is None else self.keys + self.values

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @property
    def v_dim(self) -> int | None:
        ts = self._tensors()
        return ts[-1].shape[-1] if ts else None

    @property
    def budgets(self) -> list[int] | None:
        """Tokens each kv head holds (after the prefill: the prompt tokens it kept), or None before."""
        return None if self.pos is None else [p.numel() for p in self.pos]

    def positions(self) -> list[torch.Tensor]:
        if self.prompt is not None:
            return [self.prompt[2]] * len(self.kv)
        return [torch.zeros(0, dtype=torch.long)] * len(self.kv) if self.pos is None else list(self.pos)

    def append(self, k: torch.Tensor, v: torch.Tensor, new_pos: torch.Tensor) -> None:
        if self.keys is None:
            if self.prompt is not None:
                raise AssertionError("headlab: a SnapKV group took two chunks before its prefill's attention")
            self.prompt = (k, v, new_pos.clone())
            return
        for i in range(len(self.keys)):
            self.keys[i] = torch.cat([self.keys[i], k[:, i:i + 1]], 2)
            self.values[i] = torch.cat([self.values[i], v[:, i:i + 1]], 2)
            self.pos[i] = torch.cat([self.pos[i], new_pos])

    def attend(self, attention, q, q_pos: torch.Tensor, hf, scaling, softcap, *, fresh: bool) -> torch.Tensor:
        """The group's query heads ``q (B, heads, m, d)``: the prefill (then the selection), or a later chunk."""
        m, rep = q.shape[2], self.rep
        if self.prompt is not None:
            k, v, pos = self.prompt
            vis = None
            if hf is None:
                o = attention(q, k, v, causal=True, scale=scaling)
            else:
                vis = (pos[None, :] <= q_pos[:, None]).to(q.device) & hf.index_select(-1, pos.to(hf.device))
                o = attention(q, k, v, mask=vis, scale=scaling)
            self._select(q, k, v, pos, vis, scaling, softcap)
            return o
        outs = []
        for i, (k, v, pos) in enumerate(zip(self.keys, self.values, self.pos)):
            qi = q[:, i * rep:(i + 1) * rep]
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
        if r.window > n:
            raise InputError(f"{r!r}: the observation window is {r.window} tokens but the prompt has {n}: give a "
                             f"prompt of at least {r.window} tokens, or a smaller window (window={max(1, n // 4)})")
        heads = k.shape[1]
        keep_all = (r.group_total(heads) >= heads * n) if r.adaptive else r.budget >= n
        if keep_all:
            idx = [torch.arange(n)] * heads
        else:
            rows = None if vis is None else vis[..., n - r.window:, :]
            scores = snap_scores(q[:, :, n - r.window:], k, scale=scaling, softcap=softcap, mask=rows, pool=r.pool,
                                 pooling=r.pooling)[0].cpu()  # (heads, n - window): one sequence
            idx = snap_select(scores, r, n)
        self.keys = [k[:, i:i + 1].index_select(2, j.to(k.device)).contiguous() for i, j in enumerate(idx)]
        self.values = [v[:, i:i + 1].index_select(2, j.to(v.device)).contiguous() for i, j in enumerate(idx)]
        self.pos = [pos[j] for j in idx]
        self.prompt = None


def _split(res, need: bool):
    return res if need else (res, None)


class HeadLayer(CacheLayerMixin):
    """One layer of a :class:`HeadCache`: its groups, and how many tokens it has seen."""

    is_sliding = False
    is_compileable = False

    def __init__(self, rules: list[Rule], n_heads: int, owner: HeadCache | None = None, index: int = 0):
        super().__init__()
        g = len(rules)
        if n_heads % g:
            raise ConfigError(f"{n_heads} query heads do not divide into {g} kv heads")
        rep = n_heads // g
        self.seen, self.owner, self.index = 0, owner, index
        by_rule: dict[Rule, list[int]] = {}
        for j, r in enumerate(rules):
            by_rule.setdefault(r, []).append(j)
        for r, heads in by_rule.items():
            r.check_heads(len(heads), index)
        self.groups = [_STORES.get(r.kind, _QGroup if r.special else _Group)(r, heads, rep, g)
                       for r, heads in by_rule.items()]

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``(B, Hkv, m, d)`` new keys/values; returns ``(GroupedKV, GroupedKV)`` for the attention."""
        self.is_initialized = True
        if key_states.shape[0] != 1:
            raise ShapeError(f"a per-head KV cache holds one sequence, got a batch of {key_states.shape[0]}; decode "
                             "the sequences one at a time (or use the model's own cache for batches)")
        m = key_states.shape[2]
        new_pos = torch.arange(self.seen, self.seen + m)
        for g in self.groups:
            if isinstance(g.rule, Drop):
                continue
            if g.whole:
                g.append(key_states, value_states, new_pos)
            else:
                g.append(key_states.index_select(1, g.kv.to(key_states.device)),
                         value_states.index_select(1, g.kv.to(value_states.device)), new_pos)
        first, self.seen = self.seen, self.seen + m
        view = GroupedKV(self, first, m)
        return view, view

    def nbytes(self) -> int:
        return sum(g.nbytes() for g in self.groups)

    def positions(self) -> list[torch.Tensor]:
        """The positions of the keys each kv head holds, per kv head (ascending for 16-bit and SnapKV heads)."""
        out: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)] * sum(len(g.kv) for g in self.groups)
        for g in self.groups:
            if isinstance(g.rule, Drop):
                continue
            if isinstance(g, _SnapGroup):
                per = g.positions()
            elif isinstance(g, _QGroup):
                held = any(t is not None for t in g._tensors())
                per = [g.held()[2] if held else torch.zeros(0, dtype=torch.long)] * len(g.kv)
            else:
                per = [g.pos.clone()] * len(g.kv)
            for j, p in zip(g.kv.tolist(), per):
                out[j] = p
        return out

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for g in self.groups:
            g.reset()
        self.seen = 0
        if self.owner is not None:
            self.owner._note_bytes(self.index, 0)

    def crop(self, max_length: int) -> None:
        raise ConfigError("a per-head KV cache cannot be cropped (evicted keys are gone); use a full cache "
                          "for assisted decoding")

    def reorder_cache(self, beam_idx) -> None:
        raise ConfigError("a per-head KV cache does not support beam search; decode greedily or by sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise ConfigError("a per-head KV cache holds one sequence; use num_return_sequences=1")

    def batch_select_indices(self, indices) -> None:
        raise ConfigError("a per-head KV cache holds one sequence; it cannot select batch rows")


class GroupedKV:
    """What :meth:`HeadLayer.update` hands the attention: the layer's groups and the new queries' positions."""

    def __init__(self, layer: HeadLayer, first: int, m: int):
        self.layer, self.first, self.m = layer, first, m

    def headlab_attend(self, module, query: torch.Tensor, attention_mask: torch.Tensor | None, *,
                       scaling: float | None, softcap: float | None = None) -> tuple[torch.Tensor, None]:
        """Attention of ``query (B, H, m, d)`` against each group's keys; returns ``(out (B, m, H, d), None)``.

        ``attention_mask``: the model's own mask (boolean or additive, ``(B, 1, m, seen)``) or None for
        plain causal; it is intersected with each head's rule (padding, a model's own sliding window).
        ``softcap``: Gemma 2's tanh soft-capping of the scores, applied as a score_mod.
        """
        from headlab.models.hf.attention_fn import hf_mask_to_bool

        layer, m = self.layer, self.m
        B, H, _, d = query.shape
        if B != 1:
            raise ShapeError(f"a per-head KV cache holds one sequence, got a batch of {B}; decode the sequences one "
                             "at a time")
        out = query.new_zeros(B, H, m, next((g.v_dim for g in layer.groups if g.v_dim is not None), d))
        hf = hf_mask_to_bool(attention_mask)
        extra = {"score_mod": _softcap(softcap)} if softcap is not None else {}

        def attention(*args, **kw):
            return _attention(*args, **kw, **extra)

        q_pos = torch.arange(self.first, self.first + m)
        last = self.first + m - 1
        fresh = self.first == 0  # a prefill into an empty cache
        for g in layer.groups:
            if isinstance(g.rule, Drop):
                continue
            q = query if g.whole else query.index_select(1, g.q.to(query.device))  # (B, heads of group, m, d)
            if not isinstance(g, _Group):  # quantized, compensated or SnapKV: stores, selects, evicts itself
                o = g.attend(attention, q, q_pos, hf, scaling, softcap, fresh=fresh)
            elif m == 1 and hf is None:
                g.evict(last)  # the group holds what the new query may see (a decode step evicted in place)
                if softcap is None:  # every held key is visible: torch's fused kernel, NaN kept as NaN
                    o = F.scaled_dot_product_attention(q, g.keys, g.values, scale=scaling, enable_gqa=True)
                else:
                    o = attention(q, g.keys, g.values, scale=scaling)
            elif fresh and hf is None and isinstance(g.rule, Full):
                o = attention(q, g.keys, g.values, causal=True, scale=scaling)
            elif fresh and hf is None:
                o = window_prefill(attention, q, g.keys, g.values, g.rule, scaling,
                                   backend="sparse" if m >= SPARSE_PREFILL else "auto")
            else:  # general: positions held, the model's mask, the rule
                vis = visibility(g.rule, q_pos[:, None], g.pos[None, :]).to(query.device)  # (m, kept)
                if hf is not None:
                    vis = vis & hf.index_select(-1, g.pos.to(hf.device))  # (B, 1, m, kept)
                o = attention(q, g.keys, g.values, mask=vis, scale=scaling)
            if g.whole:
                out = o.to(out.dtype)
            else:
                out.index_copy_(1, g.q.to(out.device), o.to(out.dtype))
            if isinstance(g, _Group):
                g.evict(last)
        if layer.owner is not None:
            layer.owner._note_bytes(layer.index, layer.nbytes())
        return out.transpose(1, 2).contiguous(), None


def window_prefill(attention, q, k, v, rule: Window, scale, *, backend: str, return_lse: bool = False):
    """A windowed group's prefill, ``(B, heads, n, d)``, without materialising any ``n x n`` matrix.

    The keys a query ``t`` sees split into two disjoint sets: the band ``0 <= t - j < recent`` (a sliding
    window, which the sparse kernel runs as a band) and the sinks ``j < sink`` with ``t - j >= recent``
    (at most ``sink`` keys per row). Each part returns its output and log-sum-exp; they merge as
    FlashAttention merges tiles: ``lse = logaddexp(l1, l2)``, ``out = o1 e^(l1 - lse) + o2 e^(l2 - lse)``.
    With ``return_lse``, ``(out, lse)``.
    """
    n = q.shape[2]
    parts = []
    if rule.recent >= 2:
        parts.append(attention(q, k, v, mask=masks.sliding_window(rule.recent - 1, causal=True), scale=scale,
                               backend=backend, return_lse=True))
    elif rule.recent == 1:
        parts.append(attention(q, k, v, mask=masks.as_mask(lambda b, h, i, j: i == j), scale=scale, return_lse=True))
    if rule.sink:
        s = min(rule.sink, n)
        t, j = torch.arange(n)[:, None], torch.arange(s)[None, :]
        vis = ((j <= t) & (t - j >= rule.recent)).to(q.device)  # (n, s): sinks outside the band
        parts.append(attention(q, k[:, :, :s], v[:, :, :s], mask=vis, scale=scale, return_lse=True))
    if len(parts) == 1:
        return parts[0] if return_lse else parts[0][0]
    (o1, l1), (o2, l2) = parts  # a row with no sink outside its band: l2 = -inf, weight 0
    lse = torch.logaddexp(l1, l2)
    w2 = torch.exp(l2 - lse).nan_to_num(0.0).unsqueeze(-1)
    out = o1.mul_(torch.exp(l1 - lse).unsqueeze(-1)).add_(o2.mul_(w2))
    return (out, lse) if return_lse else out


_STORES = {"snap": _SnapGroup}  # rule kinds held apart (else: _QGroup for quantized/compensated, _Group)


class HeadCache(Cache):
    """A transformers ``Cache`` whose kv heads each keep what a :class:`~headlab.kv.Policy` says.

    Args:
        model: the Hugging Face causal LM (or a LoadedModel / adapter of one).
        policy: the policy (default: every head full, the ordinary cache).

    The model's attention implementation is switched to ``"headlab"`` (the same attention, through
    headlab's backends), which is what reads the grouped cache.

    Attributes:
        peak_bytes: the most bytes the cache's tensors held after any layer's step.
    """

    def __init__(self, model, policy: Policy | None = None):
        from headlab.models.loaded_model import resolve

        adapter, _ = resolve(model)
        check_decoder(adapter, getattr(getattr(adapter.model, "config", None), "model_type", "the model"))
        heads, kvh = kv_layout(adapter)
        self.policy = policy if policy is not None else Policy.uniform("full")
        self.policy.check(kvh)
        head_dim = getattr(adapter, "head_dim", None)
        if isinstance(head_dim, int):
            self.policy.check_shape(kvh, head_dim)
        layers = [HeadLayer(self.policy.layer_rules(l, g), h, self, l) for l, (h, g) in enumerate(zip(heads, kvh))]
        super().__init__(layers=layers)
        self._bytes = [0] * len(layers)  # each layer's, after its last step
        self._total = 0
        self.peak_bytes = 0
        hf = getattr(adapter, "model", None)
        impl = getattr(getattr(hf, "config", None), "_attn_implementation", None)
        if impl is not None and impl != "headlab" and hasattr(hf, "set_attn_implementation"):
            import headlab.models.hf.attention_fn  # noqa: F401  registers "headlab"

            hf.set_attn_implementation("headlab")

    def nbytes(self) -> int:
        """Bytes the cache's key and value tensors hold now."""
        return sum(layer.nbytes() for layer in self.layers)

    def positions(self, layer: int, kv_head: int) -> torch.Tensor:
        """The positions of the keys ``kv_head`` of ``layer`` holds now (SnapKV: the prompt tokens it kept, then
        the later ones)."""
        return self.layers[layer].positions()[kv_head]

    def _note_bytes(self, layer: int, held: int) -> None:
        """A layer has stepped and now holds ``held`` bytes: update the total and its peak."""
        self._total += held - self._bytes[layer]
        self._bytes[layer] = held
        self.peak_bytes = max(self.peak_bytes, self._total)
