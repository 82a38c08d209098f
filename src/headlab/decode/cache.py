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

This module holds :class:`HeadCache`, :class:`HeadLayer` and :class:`GroupedKV`; the groups are in
:mod:`headlab.decode.groups` (``_Group``, ``_QGroup``, :func:`window_prefill`) and
:mod:`headlab.decode.snap_group` (``_SnapGroup``, :func:`snap_scores`, :func:`snap_select`), re-exported here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin

from headlab.attention.core import attention as _attention
from headlab.attention.score_mods import softcap as _softcap
from headlab.decode.groups import (_NO_POS, SPARSE_PREFILL, _cat, _Group, _QGroup, _rows,  # noqa: F401  re-exported
                                   _split, window_prefill)
from headlab.decode.kv import (Drop, Full, Policy, Rule, Snap, Window, check_decoder,  # noqa: F401
                               key_boundary, kv_layout, value_boundary, visibility)
from headlab.decode.snap_group import _SnapGroup, snap_scores, snap_select  # noqa: F401  re-exported
from headlab.errors import ConfigError, ShapeError

__all__ = ["HeadCache", "HeadLayer", "GroupedKV"]


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
