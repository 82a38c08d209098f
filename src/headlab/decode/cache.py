"""A KV cache shaped per head, as a transformers ``Cache``: each kv head holds only what its rule keeps.

:class:`HeadCache` plugs into Hugging Face generation (``model.generate(..., cache=HeadCache(model,
policy))``) and into :func:`headlab.generate`. Per layer, the kv heads are split into **groups** that
share a rule: one tensor pair ``(B, heads in group, kept, d)`` per group, so a windowed head holds
``sink + recent`` keys and a dropped head none; the bytes are real (``nbytes`` of the tensors).

How it reaches attention: ``update`` returns a :class:`GroupedKV` in place of the key tensor, a key object that
attends itself (:class:`headlab.models.hf.attention_fn.SelfAttendingKeys`, the hook the attention implementation
``"headlab"`` offers, to which the cache switches the model); its :meth:`GroupedKV.headlab_attend` runs each
group's query heads on that group's keys. Each group is the **store** its rule names (``rule.store``, looked up in
:data:`STORES`), and asks the rule what to show and keep:

- a prefill (queries from an empty cache) runs the rule's own ``prefill``: a window its band
  ``0 <= query - key < recent`` on the ``sparse`` backend (only the window's tiles) and its sinks apart, merged by
  log-sum-exp (:meth:`~headlab.kv.Window.prefill`); a full group causal on ``auto``;
- a decode step evicts first (what ``rule.retain`` lets go), then attends to all that is held;
- dropped groups (store ``"none"``) hold nothing and their query heads output zeros.

Keys keep their original positions (rotary embeddings are applied before caching), so a decode under
the policy equals one forward with the policy's visibility (:meth:`headlab.kv.Policy.visible`).

A group whose rule is quantized (``bits`` 8, 4, 2) or compensated is held by :class:`QuantStore` (the plain
groups above are untouched, bit for bit): keys and values as KIVI stores them (Liu et al. 2024; codes,
scales and zero points, :mod:`headlab.decode.quant`, with the most recent tokens in full precision),
read back for each step's attention; a compensated window keeps the mean of what it evicted as one more
key/value pair, weighted by the count it stands for (Tang et al. 2024, RazorAttention).

A group under a SnapKV or Ada-KV rule is held by :class:`SnapStore`: its prefill runs causal over the whole
prompt, then each kv head keeps, in tensors of its own, the prompt tokens its observation window attends to
most (:func:`snap_scores`, :func:`snap_select`; Li et al. 2024, Feng et al. 2024) and every later token.

This module holds :class:`HeadCache`, :class:`HeadLayer` and :class:`GroupedKV`; a store is a
:class:`~headlab.decode.store.KVStore` registered in :data:`~headlab.decode.store.STORES` (re-exported here): the
built-in ones are in :mod:`headlab.decode.groups` (``DroppedStore``, ``PlainStore``),
:mod:`headlab.decode.quant_store` (``QuantStore``) and :mod:`headlab.decode.snap_group` (``SnapStore``, :func:`snap_scores`, :func:`snap_select`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import headlab.checks as checks
from headlab.attention.core import attention as _attention
from headlab.costs.model import parse_dtype
from headlab.decode import groups, quant_store, snap_group  # noqa: F401  (they register the built-in stores)
from headlab.decode.kv import (  # noqa: F401  (re-exported: importable from here as before)
    Drop,
    Full,
    Rule,
    Snap,
    Window,
    check_decoder,
    key_boundary,
    kv_layout,
    value_boundary,
)
from headlab.decode.policy import Policy, visibility  # noqa: F401  (re-exported: importable from here as before)
from headlab.decode.store import STORES, KVStore, store_for  # STORES, KVStore: re-exported
from headlab.errors import ConfigError, ShapeError
from headlab.models.hf.attention_fn import SelfAttendingKeys, hf_mask_to_bool
from headlab.spec.score_mods import softcap as _softcap

__all__ = ["HeadCache", "HeadLayer", "GroupedKV", "KVStore", "STORES"]


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
            store_for(r)  # every rule's store is registered before any is built
        self.groups: list[KVStore] = [store_for(r)(r, heads, rep, g) for r, heads in by_rule.items()]

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``(B, Hkv, m, d)`` new keys/values; returns ``(GroupedKV, GroupedKV)`` for the attention."""
        self.is_initialized = True
        if key_states.shape[0] != 1:
            raise ShapeError(
                f"a per-head KV cache holds one sequence, got a batch of {key_states.shape[0]}; decode "
                "the sequences one at a time (or use the model's own cache for batches)"
            )
        m = key_states.shape[2]
        new_pos = torch.arange(self.seen, self.seen + m)
        for g in self.groups:
            g.take(key_states, value_states, new_pos)
        first, self.seen = self.seen, self.seen + m
        view = GroupedKV(self, first, m)
        return view, view

    def nbytes(self) -> int:
        return sum(g.nbytes() for g in self.groups)

    def positions(self) -> list[torch.Tensor]:
        """The positions of the keys each kv head holds, per kv head (ascending for 16-bit and SnapKV heads)."""
        out: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)] * sum(len(g.kv) for g in self.groups)
        for g in self.groups:
            for j, p in zip(g.kv.tolist(), g.positions()):
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
        raise ConfigError(
            "a per-head KV cache cannot be cropped (evicted keys are gone); use a full cache for assisted decoding"
        )

    def reorder_cache(self, beam_idx) -> None:
        raise ConfigError("a per-head KV cache does not support beam search; decode greedily or by sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise ConfigError("a per-head KV cache holds one sequence; use num_return_sequences=1")

    def batch_select_indices(self, indices) -> None:
        raise ConfigError("a per-head KV cache holds one sequence; it cannot select batch rows")


class GroupedKV(SelfAttendingKeys):
    """What :meth:`HeadLayer.update` hands the attention in place of its keys (and values): the layer's groups and
    the new queries' positions, a key object that attends itself."""

    def __init__(self, layer: HeadLayer, first: int, m: int):
        self.layer, self.first, self.m = layer, first, m

    def headlab_attend(
        self,
        module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        scaling: float | None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Attention of ``query (B, H, m, d)`` against each group's keys; returns ``(out (B, m, H, d), None)``.

        ``attention_mask``: the model's own mask (boolean or additive, ``(B, 1, m, seen)``) or None for
        plain causal; it is intersected with each head's rule (padding, a model's own sliding window).
        ``softcap``: Gemma 2's tanh soft-capping of the scores, applied as a score_mod.
        """
        layer, m = self.layer, self.m
        B, H, _, d = query.shape
        if B != 1:
            raise ShapeError(
                f"a per-head KV cache holds one sequence, got a batch of {B}; decode the sequences one at a time"
            )
        out = query.new_zeros(B, H, m, next((g.v_dim for g in layer.groups if g.v_dim is not None), d))
        hf = hf_mask_to_bool(attention_mask)
        extra = {"score_mod": _softcap(softcap)} if softcap is not None else {}

        def attention(*args, **kw):
            return _attention(*args, **kw, **extra)

        q_pos = torch.arange(self.first, self.first + m)
        fresh = self.first == 0  # a prefill into an empty cache
        for g in layer.groups:  # each store stores, selects and evicts as its rule says
            o = g.read(attention, query, q_pos, hf, scaling, softcap, fresh=fresh)  # (B, heads of group, m, dv)
            if o is None:  # dropped heads: their output stays zero
                continue
            if g.whole:
                out = o.to(out.dtype)
            else:
                out.index_copy_(1, g.q.to(out.device), o.to(out.dtype))
        if layer.owner is not None:
            layer.owner._note_bytes(layer.index, layer.nbytes())
        return out.transpose(1, 2).contiguous(), None


class HeadCache(Cache):
    """A transformers ``Cache`` whose kv heads each keep what a :class:`~headlab.kv.Policy` says.

    Args:
        model: the Hugging Face causal LM (or a LoadedModel / adapter of one).
        policy: the policy (default: every head full, the ordinary cache).
        dtype: the dtype the cache holds its keys and values in (and a quantized head its scales, zero points and
            full-precision residual), when not the model's: ``torch.float16`` or ``"bfloat16"`` holds a 16-bit
            cache under a float32 model on the CPU (each step computes in the model's dtype). Full, windowed,
            dropped, quantized and token-budget rules (SnapKV, Ada-KV, Expected Attention) take it; a rule whose store
            the user registered is refused.
        codes: a quantized head's decode step attends on its codes (:func:`headlab.decode.codes.attend_codes`,
            the default); False reads the cache back (dequantizes) and then attends, as round two did.

    The model's attention implementation is switched to ``"headlab"`` (the same attention, through
    headlab's backends), which is what reads the grouped cache.

    Attributes:
        peak_bytes: the most bytes the cache's tensors held after any layer's step.
    """

    layers: list[HeadLayer]  # type: ignore[assignment]  # transformers types them as any cache layer: here, ours

    def __init__(self, model, policy: Policy | None = None, *, dtype=None, codes: bool = True):
        from headlab.models.loaded_model import resolve

        adapter, _ = resolve(model)
        check_decoder(adapter, getattr(getattr(adapter.model, "config", None), "model_type", "the model"))
        heads, kvh = kv_layout(adapter)
        self.policy = policy if policy is not None else Policy.uniform("full")
        self.policy.check(kvh)
        head_dim = getattr(adapter, "head_dim", None)
        if isinstance(head_dim, int):
            self.policy.check_shape(kvh, head_dim)
        # sharded by tensor parallelism: this rank's cache holds its own kv heads (and serves its query heads) only
        self.placement = adapter.placement
        layers = [
            HeadLayer(*_rank_share(self.policy.layer_rules(l, g), h, self.placement), self, l)
            for l, (h, g) in enumerate(zip(heads, kvh))
        ]
        check_storage(dtype, [self.policy])
        _hold(layers, dtype, codes)
        if any(g.name == "snap" for layer in layers for g in layer.groups):
            from headlab.decode.expected import find_rotary

            rotary = find_rotary(adapter.model)
            for layer in layers:
                for g in layer.groups:
                    if g.name == "snap":
                        g.rotary = rotary  # type: ignore[attr-defined]  # SnapStore's (Expected Attention reads it)
        super().__init__(layers=layers)  # type: ignore[arg-type]  # list is invariant: HeadLayer is a CacheLayerMixin
        self._bytes = [0] * len(layers)  # each layer's, after its last step
        self._total = 0
        self.peak_bytes = 0
        hf = getattr(adapter, "model", None)
        impl = getattr(getattr(hf, "config", None), "_attn_implementation", None)
        if impl is not None and impl != "headlab" and hf is not None and hasattr(hf, "set_attn_implementation"):
            hf.set_attn_implementation("headlab")  # registered by headlab.models.hf.attention_fn, imported above

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


STORAGE_STORES = ("plain", "quant", "none", "snap")  # the stores that hold keys in a storage dtype of the cache's own


def check_storage(dtype, policies=(), *, name: str = "dtype") -> torch.dtype | None:
    """The storage dtype a :class:`HeadCache` takes (None: the model's): a floating dtype, and only if every rule of
    ``policies`` is held by a store that takes one (headlab's all do; a store registered by a user, not named in
    ``STORAGE_STORES``, keeps the model's dtype). Raises :class:`ConfigError`
    naming ``name``; called before a model is loaded by the commands that take ``--kv-dtype``."""
    if dtype is None:
        return None
    try:
        storage = parse_dtype(dtype)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    if not storage.is_floating_point:
        raise ConfigError(
            f"{name}={dtype!r}: a cache holds its keys and values in a floating dtype (float16, bfloat16, float32)"
        )
    for p in policies:
        for rule in (p.default, *p.rules.values()):
            if rule.store not in STORAGE_STORES:
                raise ConfigError(
                    f"{name}={dtype!r} sets how headlab's stores hold their keys; "
                    f"{rule!r} is held by the store {rule.store!r}, which keeps the model's dtype"
                )
    return storage


def _hold(layers: list[HeadLayer], dtype, codes) -> None:
    """Tell each store its storage dtype (None: the model's) and whether a quantized one attends on its codes."""
    checks.boolean("codes", codes)
    storage = check_storage(dtype)  # the policy's rules were checked against it by HeadCache (check_storage)
    for layer in layers:
        for g in layer.groups:
            g.storage = storage
            if hasattr(g, "codes"):
                g.codes = codes


def _rank_share(rules: list[Rule], n_heads: int, placement) -> tuple[list[Rule], int]:
    """The rules of the kv heads this rank holds and its query-head count (all of them unless the model is sharded
    by heads): a kv head's cache lives on the rank that computes it (``placement.kv_heads()``, in global order)."""
    if not placement.sharded:
        return rules, n_heads
    mine = placement.kv_heads()
    return rules[mine.start : mine.stop], n_heads // placement.tensor_size
