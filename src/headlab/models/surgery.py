"""Physical head removal: :func:`prune` slices W_Q, W_K, W_V, W_O (and their biases) layer by layer.

The pruned model really computes less (its projections are smaller) and equals the gated model
(the original with ``gates[l, h] = 0`` for every removed head) to float precision. How a layer is cut
is the family's business, asked of the adapter only: ``adapter.cut_heads(attn, out, q_heads, kv_heads,
H, Hkv)`` slices the projections (separate, fused or Conv1D, as the family declares them) and updates the
module's head counts, ``adapter.zero_heads(out, heads, H=)`` zeroes W^O blocks, and
``adapter.prune_config(config, H, Hkv)`` writes uniform counts into a config that can say them.

Grouped-query attention (``Hkv < H``, ``G = H // Hkv`` query heads per KV head, query head h reads
KV head ``h // G``): a KV head goes only when every query head of its group has gone. The kernels
need every surviving group of a layer to hold the same number of query heads. When a pruning
leaves groups uneven, ``gqa="pad"`` (default) keeps each group at the size of the largest one by
retaining some of its removed heads with their W^O block set to zero (exact: they add nothing,
they still cost their Q projection), and says which in :attr:`PruneResult.notes`; ``gqa="strict"``
refuses with :class:`~headlab.errors.PruneError`.

Pruning every head of a layer is refused unless ``allow_empty_layers=True``: the layer's attention
then outputs only W^O's bias (one zero-output head is kept so the module still runs).

A model sharded by tensor parallelism (``headlab.load(..., tensor_parallel=True)``) is pruned on every rank at once
(every rank calls :func:`prune` alike): the plan is made in global head indices as in one process, and then each rank
cuts its own DTensor shards (its query heads, its kv heads, its columns of W^O) and wraps them again on the same
mesh, so the copy is sharded as transformers shards it and its logits equal the one-process pruned model's. That
needs balanced shards: every rank must keep as many query and kv heads as the others, in every layer; a pruning
that would not is refused with :class:`~headlab.errors.PruneError`, naming what each rank would keep and a
balanced removal (:func:`~headlab.models.prune_plan.check_balanced`).

    >>> import torch
    >>> from headlab.models import adapt
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4)).eval()
    >>> r = prune(adapt(m), {0: [1, 2], 1: [3]})
    >>> [len(k) for k in r.kept], r.model.blocks[0].attn.q_proj.weight.shape
    ([2, 3], torch.Size([16, 32]))
    >>> a = adapt(m); a.gates[0, [1, 2]] = 0; a.gates[1, 3] = 0
    >>> ids = torch.randint(0, 50, (2, 9))
    >>> torch.allclose(m(ids).logits, r.model(ids).logits, atol=1e-5)
    True
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, cast

from torch import nn

from headlab.errors import ConfigError, PruneError
from headlab.models import tp_mesh  # a sharded model's DTensors: copied, unwrapped to this rank's shard, rewrapped
from headlab.models.base import ModelAdapter
from headlab.models.prune_plan import LayerPlan, LocalPlan, check_balanced, check_heads, plan_layer


@dataclass
class PruneResult:
    """A physically pruned copy: ``model``, its ``adapter``, the ``plans`` per layer and ``notes``."""

    model: nn.Module
    adapter: ModelAdapter
    plans: list[LayerPlan]
    notes: list[str] = field(default_factory=list)

    @property
    def kept(self) -> list[tuple[int, ...]]:
        return [p.live for p in self.plans]

    @property
    def uniform(self) -> bool:
        """Every layer keeps the same number of query and KV heads (a plain HF config can say it)."""
        return len({(len(p.q), len(p.kv)) for p in self.plans}) == 1


def prune(
    adapter: ModelAdapter, heads: dict, *, allow_empty_layers: bool = False, gqa: Literal["pad", "strict"] = "pad"
) -> PruneResult:
    """A physically pruned deep copy of ``adapter.model`` (the input is left untouched).

    Args:
        adapter: the model's adapter (``headlab.models.adapt(model)`` or ``loaded.adapter``).
        heads: ``{layer: [head, ...]}`` in the model's current head indices.
        allow_empty_layers: allow removing every head of a layer (its attention then outputs b_O only).
        gqa: ``"pad"`` or ``"strict"``; see the module docstring.

    The copy's gates are the input's gates at the kept heads, so it equals the gated original.
    """
    if gqa not in ("pad", "strict"):
        raise ConfigError(f"gqa must be 'pad' or 'strict', got {gqa!r}")
    heads = check_heads(adapter, heads)
    base_plans = getattr(adapter, "plans", None)  # pruning an already pruned model: compose
    plans, notes = [], []
    for layer in range(adapter.n_layers):
        H, Hkv = adapter.layer_heads[layer], adapter.layer_kv_heads[layer]
        already_zero = list(base_plans[layer].zeroed_local) if base_plans else []
        plan, note = plan_layer(
            H,
            Hkv,
            sorted(set(heads.get(layer, [])) | set(already_zero)),
            layer=layer,
            allow_empty_layers=allow_empty_layers,
            gqa=gqa,
        )
        plans.append(plan)
        if note:
            notes.append(note)
    tp = adapter.placement  # sharded by tensor parallelism: each rank cuts its own heads
    if tp.sharded:
        check_balanced(plans, tp, heads)
    model = _stripped_copy(adapter.model, tp_mesh.sharded_memo(adapter.model) if tp.sharded else None)
    attn, outs = same_modules(adapter, model)
    gates = adapter.gates.detach().clone()
    counts = [(adapter.layer_heads[i], adapter.layer_kv_heads[i]) for i in range(adapter.n_layers)]
    if not tp.sharded:
        new = apply_plan(adapter, [LocalPlan(p) for p in plans], attn, outs, counts)
    else:
        new = apply_sharded(adapter, plans, attn, outs, counts, adapter.model, model)
    if len({(len(p.q), len(p.kv)) for p in plans}) == 1:
        # every layer alike: where the config can say it, the model saves as a stock Hugging Face folder
        adapter.prune_config(model.config, len(plans[0].q), len(plans[0].kv))
    if base_plans:  # express the plans in the original model's indices again
        plans = [
            LayerPlan(
                q=tuple(b.q[i] for i in p.q), kv=tuple(b.kv[i] for i in p.kv), zeroed=tuple(b.q[i] for i in p.zeroed)
            )
            for b, p in zip(base_plans, plans)
        ]
    pa = pruned_adapter(adapter, model, new, plans, attn, outs)
    for layer, lp in enumerate(new):
        g = gates[layer, list(lp.plan.q)]
        g[[i for i, h in enumerate(lp.plan.q) if h in lp.plan.zeroed]] = 0.0
        pa.gates[layer, : len(g)] = g
    return PruneResult(model, pa, plans, notes)


# -- the structural edit ---------------------------------------------------------------------------------------
def same_modules(adapter: ModelAdapter, copy_of_model: nn.Module) -> tuple[list, list]:
    """The attention modules and output projections of a deep copy, found by their names in the original."""
    names = {id(m): n for n, m in adapter.model.named_modules()}
    mods = dict(copy_of_model.named_modules())
    return ([mods[names[id(m)]] for m in adapter.attn_modules], [mods[names[id(m)]] for m in adapter.out_projs])


def apply_plan(
    adapter: ModelAdapter, plans: list[LocalPlan], attn_modules: list, out_projs: list, counts: list[tuple[int, int]]
) -> list[LocalPlan]:
    """Cut every layer's modules to its plan, in place, the family's way (``adapter.cut_heads``);
    ``counts[l]`` = (H_l, Hkv_l) before the cut."""
    done: dict[int, LayerPlan] = {}
    for layer, lp in enumerate(plans):
        p = lp.plan
        H, Hkv = counts[layer]
        key = id(attn_modules[layer])
        if key in done:  # a module shared by several layers (ALBERT) is cut once, for all of them
            if done[key] != p:
                raise PruneError(
                    f"layer {layer} shares its attention module with another layer (ALBERT shares one "
                    "block across layers); prune the same heads in every layer that shares it"
                )
            continue
        done[key] = p
        if len(p.q) == H and len(p.kv) == Hkv and not p.zeroed:
            continue
        adapter.cut_heads(attn_modules[layer], out_projs[layer], list(p.q), list(p.kv), H, Hkv)
        adapter.zero_heads(out_projs[layer], lp.zeroed_local, H=len(p.q))
    return plans


def _stripped_copy(model: nn.Module, memo: dict | None = None) -> nn.Module:
    """A deep copy without headlab's adapter, layer states and hooks (the copy gets its own); ``memo``: objects
    already copied (or shared), as :func:`copy.deepcopy` takes them."""
    new = copy.deepcopy(model, memo)
    for m in new.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for key in [k for k, fn in hooks.items() if getattr(fn, "__module__", "").startswith("headlab.models")]:
                del hooks[key]
        if hasattr(m, "_headlab"):
            del m._headlab
    if hasattr(new, "_headlab_adapter"):
        del new._headlab_adapter
    return new


# -- the adapter of a pruned model: per-layer head counts ------------------------------------------------------
if TYPE_CHECKING:  # a mixin of adapters: typed as one, placed before the family's class in the MRO
    _MixinBase = ModelAdapter
else:
    _MixinBase = object


class _PrunedMixin(_MixinBase):
    """Per-layer head counts on top of a family adapter (placed first in the MRO).

    ``n_heads`` is the largest count of any layer; ``gates`` is ``(n_layers, n_heads)`` and the
    entries past a layer's count are ignored. ``layer_heads[l]``, ``layer_kv_heads[l]``: the counts;
    ``plans[l]``: the original head indices each layer keeps."""

    _layer_heads: list[int]
    _layer_kv_heads: list[int]
    plans: list

    @property
    def layer_heads(self) -> list[int]:
        return list(self._layer_heads)

    @property
    def layer_kv_heads(self) -> list[int]:
        return list(self._layer_kv_heads)

    def _share_gates(self) -> None:  # headlab's Transformer: head_gate views of this layer's gates
        for i, am in enumerate(self.attn_modules):
            am.head_gate = self._gates[i, : self._layer_heads[i]]

    def __repr__(self) -> str:
        return (
            f"<Pruned {self.family} adapter: layers={self.n_layers} heads per layer={self.layer_heads} "
            f"kv heads per layer={self.layer_kv_heads}>"
        )


# what ModelAdapter.__init__ sets itself (and the pruned counts): never copied from the template
_BASE_STATE = {
    "model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "d_model",
    "attn_modules",
    "out_projs",
    "_gates",
    "_handles",
    "states",
    "site_prefixes",
    "_layer_heads",
    "_layer_kv_heads",
    "plans",
}


def pruned_adapter(
    template: ModelAdapter,
    model: nn.Module,
    plans: list[LocalPlan],
    original_plans: list[LayerPlan],
    attn: list,
    outs: list,
) -> ModelAdapter:
    """An adapter for the cut ``model``, of the template's family class with per-layer counts."""
    fam_cls: type = type(template)
    if isinstance(template, _PrunedMixin):
        fam_cls = next(c for c in fam_cls.__mro__[1:] if not issubclass(c, _PrunedMixin))
    cls = cast("type[_PrunedMixin]", type(f"Pruned{fam_cls.__name__}", (_PrunedMixin, fam_cls), {}))
    q_counts = [len(p.plan.q) for p in plans]
    kv_counts = [len(p.plan.kv) for p in plans]
    pa = cls.__new__(cls)
    pa._layer_heads, pa._layer_kv_heads, pa.plans = (
        q_counts,
        kv_counts,
        [_Plan(p.plan, o) for p, o in zip(plans, original_plans)],
    )
    # what the family's own __init__ set (its blocks, stack sizes), with modules found again in the cut model
    names = {id(m): n for n, m in template.model.named_modules()}
    mods = dict(model.named_modules())

    def same(v):
        if isinstance(v, nn.Module):
            return mods[names[id(v)]] if id(v) in names else v
        return [same(x) for x in v] if isinstance(v, list) else v

    for key, value in vars(template).items():
        if key not in _BASE_STATE:
            try:
                setattr(pa, key, same(value))
            except AttributeError:  # a read-only property in the class: it computes itself
                pass
    ModelAdapter.__init__(
        pa,
        model,
        n_layers=template.n_layers,
        n_heads=max(q_counts),
        n_kv_heads=max(kv_counts),
        head_dim=template.head_dim,
        d_model=template.d_model,
        attn_modules=attn,
        out_projs=outs,
    )
    for st, n in zip(pa.states, q_counts):  # the gate hook splits W^O's input by the layer's own count
        st.n_heads = n // pa.placement.tensor_size  # sharded: this rank's heads
    model._headlab_adapter = pa  # type: ignore[assignment]  # torch types module attributes Tensor | Module
    return pa


@dataclass(frozen=True)
class _Plan:
    """A layer's plan in the original indices, with the local indices of its zero-output heads."""

    local: LayerPlan
    original: LayerPlan

    @property
    def zeroed_local(self) -> list[int]:
        return [i for i, h in enumerate(self.local.q) if h in self.local.zeroed]

    @property
    def q(self):
        return self.original.q

    @property
    def kv(self):
        return self.original.kv


# -- a model sharded by tensor parallelism: every rank cuts its own heads -------------------------------------------
def apply_sharded(
    adapter: ModelAdapter,
    plans: list[LayerPlan],
    attn_modules: list,
    out_projs: list,
    counts: list[tuple[int, int]],
    original: nn.Module,
    copy_of_model: nn.Module,
) -> list[LocalPlan]:
    """Cut a deep copy of a sharded model, each rank its own slices: the DTensor weights of every layer's attention
    are unwrapped to this rank's local shard, cut by the family (``adapter.cut_heads`` in this rank's local head
    indices) and wrapped again as DTensors on the same mesh and placements, so the copy is sharded as
    transformers shards it, with fewer heads on every rank. The copy's tensor-parallel forwards are installed
    again on the copy's own modules (a deep copy keeps closures that still name the original's)."""
    tp = adapter.placement
    for layer, p in enumerate(plans):
        H, Hkv = counts[layer]
        if len(p.q) == H and len(p.kv) == Hkv and not p.zeroed:
            continue
        mine, kv = tp.heads(), tp.kv_heads()
        q_local = [h - mine.start for h in p.q if h in mine]
        kv_local = [g - kv.start for g in p.kv if g in kv]
        zeroed = [i for i, h in enumerate(h for h in p.q if h in mine) if h in p.zeroed]
        am, op = attn_modules[layer], out_projs[layer]
        wrapped = tp_mesh.unwrap(am, op)
        adapter.cut_heads(am, op, q_local, kv_local, H // tp.tensor_size, Hkv // tp.tensor_size)
        adapter.zero_heads(op, zeroed, H=len(q_local))
        tp_mesh.rewrap(wrapped)
        n_q, n_kv = len(q_local) * tp.tensor_size, len(kv_local) * tp.tensor_size  # the layer's global counts
        values = {"H": n_q, "Hkv": n_kv, "G": n_q // n_kv, "H*d": n_q * adapter.head_dim}
        for attr, what in getattr(adapter, "head_attrs", {}).items():
            setattr(am, attr, values[what])
    tp_mesh.reinstall_forwards(copy_of_model)
    return [LocalPlan(p) for p in plans]
