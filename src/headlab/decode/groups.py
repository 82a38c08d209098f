"""The stores of a :class:`~headlab.decode.cache.HeadCache` layer: the kv heads of one layer that share a rule, and
the keys they keep. A rule names its store (``rule.store``), and the store asks the rule what to show and what to
keep (``visible``, ``retain``, ``ring``, ``sinks``, ``prefill``), so no store knows a kind of rule by name.

:class:`~headlab.decode.store.KVStore` is what they share (which heads, taking the layer's new keys, attending with
the layer's queries); :class:`DroppedStore` holds nothing (``"none"``); :class:`PlainStore` holds a 16-bit rule
(``"plain"``: one tensor pair ``(B, heads in group, kept, d)``, a ring overwritten in place for a rule that has one);
:class:`QuantStore` a
quantized (``bits`` 8, 4, 2) or compensated one (``"quant"``): keys and values as KIVI stores them (Liu et al. 2024;
codes, scales and zero points, :mod:`headlab.decode.quant`, with the most recent tokens in full precision), read
back for each step's attention; a compensated window keeps the mean of what it evicted as one more key/value pair,
weighted by the count it stands for (Tang et al. 2024, RazorAttention).

SnapKV's and Ada-KV's store is in :mod:`headlab.decode.snap_group`; each registers itself in
:data:`headlab.decode.store.STORES` under its ``name``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headlab.decode import quant
from headlab.decode.rules import Full, Rule, Window, key_boundary, value_boundary
from headlab.decode.store import KVStore, register_store

SPARSE_PREFILL = 128  # below this many queries a window's tiles are too few for the sparse kernel to pay


@register_store
class DroppedStore(KVStore):
    """Pruned kv heads: nothing held, and their query heads' output stays zero."""

    name = "none"
    v_dim = None

    def reset(self) -> None:
        pass

    def take(self, k, v, new_pos) -> None:
        pass

    def read(self, *args, **kwargs) -> None:
        return None

    def nbytes(self) -> int:
        return 0


@register_store
class PlainStore(KVStore):
    """A 16-bit rule's heads: keys and values ``(B, heads, held, d)`` and their positions, in position order, or, for
    a rule with a ``ring``, in ring order once full (each new key overwrites the oldest past the sinks)."""

    name = "plain"
    keys: torch.Tensor | None
    values: torch.Tensor | None

    def reset(self) -> None:
        self.keys = self.values = None  # (B, heads, held, d)
        self.pos = torch.zeros(0, dtype=torch.long)  # positions of the held keys
        self.slot = self.rule.sinks  # ring: where the next key goes once full, the slot of the oldest past the sinks

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    @property
    def v_dim(self) -> int | None:  # type: ignore[override]  # from what it holds: a property over the base's None
        return self.values.shape[-1] if self.values is not None else None

    def positions(self) -> list[torch.Tensor]:
        return [self.pos.clone()] * len(self.kv)

    def append(self, k: torch.Tensor, v: torch.Tensor, new_pos: torch.Tensor) -> None:
        """Add ``(B, heads, m, d)`` keys and values at positions ``new_pos``.

        A full ring takes one new key in place: it overwrites the oldest key past the sinks (the one the new query
        no longer sees), so a decode step copies nothing. Everything else is appended (and evicted after the
        attention)."""
        r = self.rule
        if r.ring is not None and k.shape[2] == 1 and self.keys is not None and self.pos.numel() == r.ring:
            if r.ring == r.sinks:  # only the sinks are ever visible: the new key is never read
                return
            slot = self.slot
            assert self.values is not None  # held with the keys
            self.keys[:, :, slot] = k[:, :, 0]
            self.values[:, :, slot] = v[:, :, 0]
            self.pos[slot] = new_pos[0]
            self.slot = r.sinks + (slot - r.sinks + 1) % (r.ring - r.sinks)
        elif self.keys is None:
            self.keys, self.values, self.pos = k.contiguous(), v.contiguous(), new_pos.clone()
        else:
            assert self.values is not None  # held with the keys
            self.keys, self.values = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
            self.pos = torch.cat([self.pos, new_pos])

    def evict(self, last: int) -> None:
        """Keep what the rule retains once a query at position ``last`` has attended, in position order."""
        r = self.rule
        if not r.evicts or self.keys is None or (r.ring is not None and self.pos.numel() <= r.ring):
            return
        keep = r.retain(self.pos, last)
        if bool(keep.all()):
            return
        idx = keep.nonzero().squeeze(1)
        idx = idx[self.pos[idx].argsort()]
        assert self.values is not None  # held with the keys
        self.keys = self.keys.index_select(2, idx.to(self.keys.device)).contiguous()
        self.values = self.values.index_select(2, idx.to(self.values.device)).contiguous()
        self.pos = self.pos[idx]
        self.slot = r.sinks

    def attend(self, attention, q, q_pos: torch.Tensor, hf, scaling, softcap, *, fresh: bool) -> torch.Tensor:
        """The store's query heads ``q (B, heads, m, d)`` on what it holds (``hf``: the model's boolean mask or None;
        ``fresh``: a prefill into an empty cache); evicts after."""
        m, last = q.shape[2], int(q_pos[-1])
        if m == 1 and hf is None:
            self.evict(last)  # the store holds what the new query may see (a decode step evicted in place)
            assert self.keys is not None and self.values is not None  # a decode step follows the prefill
            if softcap is None:  # every held key is visible: torch's fused kernel, NaN kept as NaN
                o = F.scaled_dot_product_attention(q, self.keys, self.values, scale=scaling, enable_gqa=True)
            else:
                o = attention(q, self.keys, self.values, scale=scaling)
        elif fresh and hf is None:  # the rule's own prefill: causal, a window's band and sinks, ...
            o = self.rule.prefill(
                attention, q, self.keys, self.values, scaling, backend="sparse" if m >= SPARSE_PREFILL else "auto"
            )
        else:  # general: positions held, the model's mask, the rule
            vis = self.rule.visible(q_pos[:, None], self.pos[None, :]).to(q.device)  # (m, held)
            if hf is not None:
                vis = vis & hf.index_select(-1, self.pos.to(hf.device))  # (B, 1, m, held)
            o = attention(q, self.keys, self.values, mask=vis, scale=scaling)
        self.evict(last)
        return o


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=2)


def _rows(t: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(2, idx.to(t.device))


_NO_POS = torch.zeros(0, dtype=torch.long)


@register_store
class QuantStore(KVStore):
    """The kv heads of one layer that share a quantized or compensated rule (one that keeps every key, or evicts
    first in, first out past its sinks, up to its ``horizon``: a window).

    Held, in position order: the sinks (a window's first keys, full precision); the quantized keys (packed
    codes, and per key group of ``rule.group`` tokens a scale and a zero point per channel) and values (codes,
    and per token a scale and zero per ``rule.group`` channels); the full-precision residuals (keys from
    :func:`~headlab.kv.key_boundary`, values from :func:`~headlab.kv.value_boundary` on); and, compensated,
    the mean of the evicted keys and values with their count. A window evicts before quantizing, so a key
    group that had lost tokens to the window takes its scale from the tokens it still holds.
    """

    name = "quant"
    rule: Full | Window  # a rule with a precision (bits, group, residual)
    # what reset() sets, None while nothing of the kind is held
    sink_k: torch.Tensor | None
    sink_v: torch.Tensor | None
    kq: torch.Tensor | None
    ks: torch.Tensor | None
    kz: torch.Tensor | None
    kr: torch.Tensor | None
    vq: torch.Tensor | None
    vs: torch.Tensor | None
    vz: torch.Tensor | None
    vr: torch.Tensor | None
    comp_k: torch.Tensor | None
    comp_v: torch.Tensor | None

    def __init__(self, rule: Rule, kv_heads: list[int], rep: int, n_kv: int):
        super().__init__(rule, kv_heads, rep, n_kv)
        self.start = rule.sinks  # positions below it are sinks, in full precision
        self.compensate = bool(rule.compensate)

    def reset(self) -> None:
        self.sink_k = self.sink_v = None
        self.sink_pos = _NO_POS
        self.kq = self.ks = self.kz = None  # codes (B, h, t, d*bits/8); scale, zero (B, h, groups, d)
        self.kq_pos, self.k_gid = _NO_POS, _NO_POS
        self.kr, self.kr_pos = None, _NO_POS  # full-precision keys past the key boundary
        self.vq = self.vs = self.vz = None  # codes (B, h, t, dv*bits/8); scale, zero (B, h, t, dv/group)
        self.vq_pos = _NO_POS
        self.vr, self.vr_pos = None, _NO_POS  # full-precision values past the value boundary
        self.comp_k = self.comp_v = None  # (B, h, 1, d): the mean of the evicted keys and values
        self.comp_n = 0

    def _tensors(self):
        return (
            self.sink_k,
            self.sink_v,
            self.kq,
            self.ks,
            self.kz,
            self.kr,
            self.vq,
            self.vs,
            self.vz,
            self.vr,
            self.comp_k,
            self.comp_v,
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors() if t is not None)

    @property
    def v_dim(self) -> int | None:  # type: ignore[override]  # from what it holds: a property over the base's None
        v = self.sink_v if self.sink_v is not None else self.vr if self.vr is not None else self.vs
        if v is None:
            return None
        return v.shape[-1] if v is not self.vs else v.shape[-1] * self.rule.group

    def positions(self) -> list[torch.Tensor]:
        held = any(t is not None for t in self._tensors())
        return [self.held()[2] if held else torch.zeros(0, dtype=torch.long)] * len(self.kv)

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
        assert codes is not None and self.ks is not None and self.kz is not None  # held with the codes
        rows = self._key_scales(pos).to(self.ks.device)
        return quant.dequantize_keys(
            codes, self.ks.index_select(2, rows), self.kz.index_select(2, rows), bits=self.rule.bits
        )

    def _values(self, idx: torch.Tensor | None = None) -> torch.Tensor | None:
        if self.vq is None:
            return None
        assert self.vs is not None and self.vz is not None  # held with the codes
        if idx is None:
            return quant.dequantize_values(self.vq, self.vs, self.vz, bits=self.rule.bits)
        return quant.dequantize_values(
            self.vq.index_select(2, idx.to(self.vq.device)),
            self.vs.index_select(2, idx.to(self.vs.device)),
            self.vz.index_select(2, idx.to(self.vz.device)),
            bits=self.rule.bits,
        )

    def evict(self, last: int) -> None:
        """Drop what the query at ``last`` no longer sees (past the sinks, positions before the rule's horizon);
        compensated, fold it into the mean."""
        r = self.rule
        if not r.evicts:
            return
        cut = r.horizon(last)  # positions below it past the sinks are gone
        sums: dict[str, list[torch.Tensor]] = {"k": [], "v": []}
        gone = 0
        for name in ("kq", "kr", "vq", "vr"):
            pos = getattr(self, f"{name}_pos")
            if pos.numel() == 0 or int(pos[0]) >= cut:
                continue
            drop = int(torch.searchsorted(pos, torch.tensor(cut)))
            if self.compensate:
                idx = torch.arange(drop)
                t = (
                    self._keys(idx)
                    if name == "kq"
                    else self._values(idx)
                    if name == "vq"
                    else _rows(getattr(self, name), idx)
                )
                assert t is not None  # the part holds the keys it drops
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
                assert self.comp_v is not None  # kept with comp_k
                sk, sv = sk + self.comp_k.float() * n, sv + self.comp_v.float() * n
            assert isinstance(sk, torch.Tensor) and isinstance(sv, torch.Tensor)  # gone > 0: some sum was added
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
        elif fresh and hf is None:  # the rule's own prefill
            o, lse = _split(
                self.rule.prefill(
                    attention, q, k, v, scaling, return_lse=need, backend="sparse" if m >= SPARSE_PREFILL else "auto"
                ),
                need,
            )
        else:
            vis = self.rule.visible(q_pos[:, None], pos[None, :]).to(q.device)
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
        evicted before it (those already folded, and held ones past the sinks before its ``rule.horizon(t)``), its
        score raised by the log of their count (the token stands for that many)."""
        m = q.shape[2]
        if m == 1:
            n_t = torch.full((1,), self.comp_n, dtype=torch.float32)
            if self.comp_n == 0:
                return o
            assert self.comp_k is not None and self.comp_v is not None  # comp_n > 0
            ck, cv = self.comp_k.float(), self.comp_v.float()  # (B, h, 1, d)
        else:
            c = torch.searchsorted(pos_past, self.rule.horizon(q_pos))  # held past-sink keys each query no longer sees
            zeros_k = k_past.new_zeros(*k_past.shape[:2], 1, k_past.shape[-1], dtype=torch.float32)
            zeros_v = v_past.new_zeros(*v_past.shape[:2], 1, v_past.shape[-1], dtype=torch.float32)
            sk = torch.cat([zeros_k, k_past.float().cumsum(2)], 2).index_select(2, c.to(k_past.device))
            sv = torch.cat([zeros_v, v_past.float().cumsum(2)], 2).index_select(2, c.to(v_past.device))
            n_t = (c + self.comp_n).float()
            if self.comp_n:
                assert self.comp_k is not None and self.comp_v is not None  # comp_n > 0
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


def _split(res, need: bool):
    return res if need else (res, None)
