"""The stores of a :class:`~headlab.decode.cache.HeadCache` layer: the kv heads of one layer that share a rule, and
the keys they keep. A rule names its store (``rule.store``), and the store asks the rule what to show and what to
keep (``visible``, ``retain``, ``ring``, ``sinks``, ``prefill``), so no store knows a kind of rule by name.

:class:`~headlab.decode.store.KVStore` is what they share (which heads, taking the layer's new keys, attending with
the layer's queries); :class:`DroppedStore` holds nothing (``"none"``); :class:`PlainStore` holds a 16-bit rule
(``"plain"``: one tensor pair ``(B, heads in group, kept, d)``, a ring overwritten in place for a rule that has one);
:class:`~headlab.decode.quant_store.QuantStore`
a quantized (``bits`` 8, 4, 2) or compensated one (``"quant"``), in :mod:`headlab.decode.quant_store`.

SnapKV's and Ada-KV's store is in :mod:`headlab.decode.snap_group`; each registers itself in
:data:`headlab.decode.store.STORES` under its ``name``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headlab.decode.store import SPARSE_PREFILL, KVStore, own, register_store


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
    """A 16-bit rule's heads: keys and values ``(B, heads, held, d)`` in position order, or, for a rule with a
    ``ring``, in ring order once full (each new key overwrites the oldest past the sinks).

    The positions of what it holds follow from three integers for a rule that keeps every key or evicts first in,
    first out past its sinks (``full``, a window): ``end`` (one past the newest position), ``n`` (keys held) and the
    ring's ``slot``; so it holds no tensor of positions (:attr:`pos` computes them). A rule of another kind (one
    registered by a user) keeps them in a tensor."""

    name = "plain"
    keys: torch.Tensor | None
    values: torch.Tensor | None

    def reset(self) -> None:
        self.keys = self.values = None  # (B, heads, held, d)
        self.end = self.n = 0  # one past the newest position taken; keys held
        self.slot = self.rule.sinks  # ring: where the next key goes once full, the slot of the oldest past the sinks
        self.derived = not self.rule.evicts or self.rule.ring is not None  # positions follow from end, n and slot
        self.kept_pos = None if self.derived else torch.zeros(0, dtype=torch.long)  # else: the positions held

    @property
    def pos(self) -> torch.Tensor:
        """The positions of the held keys, in the order the keys are held."""
        if not self.derived:
            assert self.kept_pos is not None  # held when not derived
            return self.kept_pos
        if self.n == self.end:
            return torch.arange(self.end)
        s = min(self.rule.sinks, self.n)
        recent = torch.arange(self.end - (self.n - s), self.end)
        if self.slot != self.rule.sinks:  # ring order: the oldest past the sinks at the slot
            recent = recent.roll(self.slot - self.rule.sinks)
        return torch.cat([torch.arange(s), recent])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    @property
    def v_dim(self) -> int | None:  # type: ignore[override]  # from what it holds: a property over the base's None
        return self.values.shape[-1] if self.values is not None else None

    def positions(self) -> list[torch.Tensor]:
        return [self.pos.clone()] * len(self.kv)

    def append(self, k: torch.Tensor, v: torch.Tensor, new_pos: torch.Tensor) -> None:
        """Add ``(B, heads, m, d)`` keys and values at positions ``new_pos`` (following the last taken).

        A full ring takes one new key in place: it overwrites the oldest key past the sinks (the one the new query
        no longer sees), so a decode step copies nothing. Everything else is appended (and evicted after the
        attention)."""
        r = self.rule
        m = k.shape[2]
        if r.ring is not None and m == 1 and self.keys is not None and self.n == r.ring:
            self.end += 1
            if r.ring == r.sinks:  # only the sinks are ever visible: the new key is never read
                return
            slot = self.slot
            assert self.values is not None  # held with the keys
            self.keys[:, :, slot] = k[:, :, 0]
            self.values[:, :, slot] = v[:, :, 0]
            self.slot = r.sinks + (slot - r.sinks + 1) % (r.ring - r.sinks)
            return
        if self.keys is None:
            self.keys, self.values = own(k), own(v)
        else:
            assert self.values is not None  # held with the keys
            if self.slot != r.sinks:  # in ring order: back to position order first
                self._select(self.pos.argsort())
            self.keys, self.values = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        if self.kept_pos is not None:
            self.kept_pos = torch.cat([self.kept_pos, new_pos])
        self.end, self.n = self.end + m, self.n + m

    def _select(self, idx: torch.Tensor) -> None:
        """Keep the held keys ``idx`` (in that order); the slot returns to the first past the sinks."""
        assert self.keys is not None and self.values is not None  # held
        self.keys = self.keys.index_select(2, idx.to(self.keys.device)).contiguous()
        self.values = self.values.index_select(2, idx.to(self.values.device)).contiguous()
        if self.kept_pos is not None:
            self.kept_pos = self.kept_pos[idx]
        self.n, self.slot = idx.numel(), self.rule.sinks

    def evict(self, last: int) -> None:
        """Keep what the rule retains once a query at position ``last`` has attended, in position order."""
        r = self.rule
        if not r.evicts or self.keys is None or (r.ring is not None and self.n <= r.ring):
            return
        pos = self.pos
        keep = r.retain(pos, last)
        if bool(keep.all()):
            return
        idx = keep.nonzero().squeeze(1)
        self._select(idx[pos[idx].argsort()])

    def attend(self, attention, q, q_pos: torch.Tensor, hf, scaling, softcap, *, fresh: bool) -> torch.Tensor:
        """The store's query heads ``q (B, heads, m, d)`` on what it holds (``hf``: the model's boolean mask or None;
        ``fresh``: a prefill into an empty cache); evicts after."""
        m, last = q.shape[2], int(q_pos[-1])
        if m == 1 and hf is None:
            self.evict(last)  # the store holds what the new query may see (a decode step evicted in place)
        k, v = self.keys, self.values
        assert k is not None and v is not None  # the layer's new keys were taken before its attention
        if k.dtype != q.dtype:  # held in a storage dtype of its own (HeadCache(dtype=...)): computed in the query's
            k, v = k.to(q.dtype), v.to(q.dtype)
        if m == 1 and hf is None:
            if softcap is None:  # every held key is visible: torch's fused kernel, NaN kept as NaN
                o = F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=True)
            else:
                o = attention(q, k, v, scale=scaling)
        elif fresh and hf is None:  # the rule's own prefill: causal, a window's band and sinks, ...
            o = self.rule.prefill(attention, q, k, v, scaling, backend="sparse" if m >= SPARSE_PREFILL else "auto")
        else:  # general: positions held, the model's mask, the rule
            pos = self.pos
            vis = self.rule.visible(q_pos[:, None], pos[None, :]).to(q.device)  # (m, held)
            if hf is not None:
                vis = vis & hf.index_select(-1, pos.to(hf.device))  # (B, 1, m, held)
            o = attention(q, k, v, mask=vis, scale=scaling)
        self.evict(last)
        return o
