"""The store of a quantized or compensated rule's heads (``"quant"``): :class:`QuantStore`, KIVI's storage (Liu et al.
2024; codes, scales and zero points, :mod:`headlab.decode.quant`, the most recent tokens in full precision), and
RazorAttention's compensation pair (Tang et al. 2024).

Everything it holds is a tensor :meth:`QuantStore.nbytes` counts: the positions of what it holds are contiguous
ranges (the sinks, then each part up to the newest token), so they are kept as two integers per part (:class:`Span`),
not as a tensor of positions; the cache's bytes are the bytes of its tensors (``tests/test_kv_codes.py`` walks them).
A decode step attends on the codes (:func:`headlab.decode.codes.attend_codes`) unless the store is told to read
them back first (``codes = False``: dequantize, then attend, the way of round two, kept to compare with).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from headlab.attention.backends import native_codes
from headlab.decode import quant
from headlab.decode.codes import attend_codes
from headlab.decode.layout import key_boundary, value_boundary
from headlab.decode.rules import Full, Rule, Window
from headlab.decode.store import SPARSE_PREFILL, KVStore, own, register_store

__all__ = ["QuantStore", "Span"]


@dataclass
class Span:
    """Positions ``first, first + 1, ..., first + n - 1`` held by one part of a store."""

    first: int = 0
    n: int = 0

    def tensor(self) -> torch.Tensor:
        return torch.arange(self.first, self.first + self.n)

    def below(self, cut: int) -> int:
        """How many of the positions are below ``cut``."""
        return max(0, min(self.n, cut - self.first))

    def take(self, first: int, n: int) -> None:
        """Append ``n`` positions from ``first`` (which follows the last held, when any is)."""
        if self.n == 0:
            self.first = first
        self.n += n

    def drop(self, n: int) -> None:
        """Forget the first ``n`` positions."""
        self.first, self.n = self.first + n, self.n - n


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return own(b) if a is None else torch.cat([a, b], dim=2)


def _from(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Rows ``n:`` of ``t`` along the tokens, in memory of their own (None when none is left)."""
    return None if t is None or n >= t.shape[2] else own(t[:, :, n:])


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
    codes = True  # a decode step attends on the codes; False: read them back (dequantize), then attend
    native = True  # on the codes, with the compiled kernel when it is built; False: PyTorch's products
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
        self.start = rule.sinks  # positions below it are sinks, in full precision
        super().__init__(rule, kv_heads, rep, n_kv)
        self.compensate = bool(rule.compensate)

    def reset(self) -> None:
        self.sink_k = self.sink_v = None
        self.kq = self.ks = self.kz = None  # codes (B, h, t, d*bits/8); scale, zero (B, h, groups, d)
        self.kr = None  # full-precision keys past the key boundary
        self.vq = self.vs = self.vz = None  # codes (B, h, t, dv*bits/8); scale, zero (B, h, t, dv/group)
        self.vr = None  # full-precision values past the value boundary
        self.comp_k = self.comp_v = None  # (B, h, 1, d): the mean of the evicted keys and values
        self.comp_n = 0
        # positions held by each part (the sinks: 0..n-1) and the key groups' ids (one per scale row of ks)
        self.span = {name: Span() for name in ("sink", "kq", "kr", "vq", "vr", "kgroup")}

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
        return [self._positions() if held else torch.zeros(0, dtype=torch.long)] * len(self.kv)

    def _positions(self) -> torch.Tensor:
        s = self.span
        return torch.cat([s["sink"].tensor(), s["kq"].tensor(), s["kr"].tensor()])

    # -- storing -------------------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, new_pos: torch.Tensor) -> None:
        self.dtype = k.dtype
        p0, m = int(new_pos[0]), k.shape[2]
        i = max(0, min(m, self.start - p0))  # how many of the new tokens are sinks
        if i:
            self.sink_k, self.sink_v = _cat(self.sink_k, k[:, :, :i]), _cat(self.sink_v, v[:, :, :i])
            self.span["sink"].take(p0, i)
        if i < m:
            self.kr, self.vr = _cat(self.kr, k[:, :, i:]), _cat(self.vr, v[:, :, i:])
            self.span["kr"].take(p0 + i, m - i)
            self.span["vr"].take(p0 + i, m - i)

    def _gid(self, pos: int) -> int:
        return (pos - self.start) // self.rule.group

    def _key_head(self) -> int:
        """How many of the quantized keys belong to the first key group (a window may have cut it short)."""
        kq = self.span["kq"]
        return min(kq.n, (self._gid(kq.first) + 1) * self.rule.group + self.start - kq.first)

    def _keys(self, n: int | None = None) -> torch.Tensor | None:
        """The quantized keys read back (the first ``n``, or all)."""
        if self.kq is None:
            return None
        assert self.ks is not None and self.kz is not None  # held with the codes
        kq = self.span["kq"]
        pos = torch.arange(kq.first, kq.first + (kq.n if n is None else n))
        rows = torch.div(pos - self.start, self.rule.group, rounding_mode="floor") - self.span["kgroup"].first
        codes = self.kq if n is None else self.kq[:, :, :n]
        rows = rows.to(self.ks.device)
        return quant.dequantize_keys(
            codes, self.ks.index_select(2, rows), self.kz.index_select(2, rows), bits=self.rule.bits
        )

    def _values(self, n: int | None = None) -> torch.Tensor | None:
        if self.vq is None:
            return None
        assert self.vs is not None and self.vz is not None  # held with the codes
        if n is None:
            return quant.dequantize_values(self.vq, self.vs, self.vz, bits=self.rule.bits)
        return quant.dequantize_values(self.vq[:, :, :n], self.vs[:, :, :n], self.vz[:, :, :n], bits=self.rule.bits)

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
            span = self.span[name]
            drop = span.below(cut)
            if drop == 0:
                continue
            if self.compensate:
                t = (
                    self._keys(drop)
                    if name == "kq"
                    else self._values(drop)
                    if name == "vq"
                    else getattr(self, name)[:, :, :drop]
                )
                assert t is not None  # the part holds the keys it drops
                sums[name[0]].append(t.float().sum(2, keepdim=True))
                gone += drop if name[0] == "k" else 0
            span.drop(drop)
            setattr(self, name, _from(getattr(self, name), drop))
            if name == "kq":
                groups = self.span["kgroup"]
                if span.n == 0:
                    self.kq = self.ks = self.kz = None
                    groups.drop(groups.n)
                else:  # the groups that still hold a key keep their scales
                    first = self._gid(span.first) - groups.first
                    self.ks, self.kz = _from(self.ks, first), _from(self.kz, first)
                    groups.drop(first)
            elif name == "vq":
                self.vs, self.vz = _from(self.vs, drop), _from(self.vz, drop)
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
        kr, vr = self.span["kr"], self.span["vr"]
        m = kr.below(key_boundary(r, tokens))
        if self.kr is not None and m:
            x = self.kr[:, :, :m]
            g0 = self._gid(kr.first)
            head = min(m, (g0 + 1) * r.group + self.start - kr.first)  # the first group may have lost tokens
            parts = [(x[:, :, :head], head)] + ([(x[:, :, head:], r.group)] if head < m else [])
            for xs, g in parts:
                codes, sc, ze = quant.quantize_keys(xs, r.bits, g)
                self.kq, self.ks, self.kz = _cat(self.kq, codes), _cat(self.ks, sc), _cat(self.kz, ze)
            self.span["kgroup"].take(g0, self._gid(kr.first + m - 1) - g0 + 1)
            self.span["kq"].take(kr.first, m)
            kr.drop(m)
            self.kr = _from(self.kr, m)
        m = vr.below(value_boundary(r, tokens))
        if self.vr is not None and m:
            x = self.vr[:, :, :m]
            q = native_codes.quantize_values(x, r.bits, r.group) if self.native else None
            codes, sc, ze = q if q is not None else quant.quantize_values(x, r.bits, r.group)
            self.vq, self.vs, self.vz = _cat(self.vq, codes), _cat(self.vs, sc), _cat(self.vz, ze)
            self.span["vq"].take(vr.first, m)
            vr.drop(m)
            self.vr = _from(self.vr, m)

    def held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(keys, values, positions, sinks)``: everything held, read back in full precision, in position order."""
        ks = [t for t in (self.sink_k, self._keys(), self.kr) if t is not None]
        vs = [t for t in (self.sink_v, self._values(), self.vr) if t is not None]
        s = self.span
        if (
            s["kq"].n + s["kr"].n != s["vq"].n + s["vr"].n
            or (s["kq"].n or s["kr"].n)
            and ((s["kq"].first if s["kq"].n else s["kr"].first) != (s["vq"].first if s["vq"].n else s["vr"].first))
        ):
            raise AssertionError("headlab: a quantized kv group holds keys and values of different positions")
        return torch.cat(ks, 2), torch.cat(vs, 2), self._positions(), s["sink"].n

    # -- attending -----------------------------------------------------------------------------------------
    def attend(self, attention, q, q_pos: torch.Tensor, hf, scaling, softcap, *, fresh: bool) -> torch.Tensor:
        """The group's query heads ``q (B, heads, m, d)`` on what it holds; stores, evicts and quantizes."""
        m = q.shape[2]
        last = int(q_pos[-1])
        if m == 1:  # KIVI: the new token enters the cache (and the residual is quantized) before it attends
            self._step(last)
        need = self.compensate
        if m == 1 and hf is None and self.codes:  # every held key is visible: attend on the codes
            out, out_lse = self.attend_codes(q, scaling, softcap)
            if need:
                out = self._compensated(out, out_lse, q, q_pos, None, None, None, scaling, softcap)
            return out
        k, v, pos, n_sink = self.held()
        k, v = k.to(q.dtype), v.to(q.dtype)  # held in a storage dtype of its own (HeadCache(dtype=...)): the query's
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

    def attend_codes(self, q: torch.Tensor, scaling, softcap) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of the queries ``q (B, heads, m, d)`` on everything held, read from the codes."""
        s = self.span
        return attend_codes(
            q,
            keys=(self.kq, self.ks, self.kz) if self.kq is not None else None,
            key_group=self.rule.group,
            key_head=self._key_head() if self.kq is not None else None,
            values=(self.vq, self.vs, self.vz) if self.vq is not None else None,
            bits=self.rule.bits,
            scale=scaling,
            softcap=softcap,
            full_before=(self.sink_k, self.sink_v) if s["sink"].n else None,  # type: ignore[arg-type]
            keys_after=self.kr,
            values_after=self.vr,
            native=self.native,
        )

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
