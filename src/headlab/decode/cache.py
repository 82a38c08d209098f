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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from headlab.attention import masks
from headlab.attention.core import attention as _attention
from headlab.attention.score_mods import softcap as _softcap
from headlab.decode.kv import Drop, Full, Policy, Rule, Window, check_decoder, kv_layout, visibility
from headlab.errors import ConfigError

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
        self.groups = [_Group(r, heads, rep, g) for r, heads in by_rule.items()]

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``(B, Hkv, m, d)`` new keys/values; returns ``(GroupedKV, GroupedKV)`` for the attention."""
        self.is_initialized = True
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

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for g in self.groups:
            g.keys = g.values = None
            g.pos = torch.zeros(0, dtype=torch.long)
            g.ring = g.rule.sink if isinstance(g.rule, Window) else 0
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
        out = query.new_zeros(B, H, m, layer.groups[0].values.shape[-1] if layer.groups[0].values is not None
                              else d)
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
            if m == 1 and hf is None:
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
            g.evict(last)
        if layer.owner is not None:
            layer.owner._note_bytes(layer.index, layer.nbytes())
        return out.transpose(1, 2).contiguous(), None


def window_prefill(attention, q, k, v, rule: Window, scale, *, backend: str) -> torch.Tensor:
    """A windowed group's prefill, ``(B, heads, n, d)``, without materialising any ``n x n`` matrix.

    The keys a query ``t`` sees split into two disjoint sets: the band ``0 <= t - j < recent`` (a sliding
    window, which the sparse kernel runs as a band) and the sinks ``j < sink`` with ``t - j >= recent``
    (at most ``sink`` keys per row). Each part returns its output and log-sum-exp; they merge as
    FlashAttention merges tiles: ``lse = logaddexp(l1, l2)``, ``out = o1 e^(l1 - lse) + o2 e^(l2 - lse)``.
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
        return parts[0][0]
    (o1, l1), (o2, l2) = parts  # a row with no sink outside its band: l2 = -inf, weight 0
    lse = torch.logaddexp(l1, l2)
    w2 = torch.exp(l2 - lse).nan_to_num(0.0).unsqueeze(-1)
    return o1.mul_(torch.exp(l1 - lse).unsqueeze(-1)).add_(o2.mul_(w2))


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

    def _note_bytes(self, layer: int, held: int) -> None:
        """A layer has stepped and now holds ``held`` bytes: update the total and its peak."""
        self._total += held - self._bytes[layer]
        self._bytes[layer] = held
        self.peak_bytes = max(self.peak_bytes, self._total)
