"""What a pruning keeps, layer by layer: the plan :func:`~headlab.models.surgery.prune` cuts by.

:func:`check_heads` validates the heads asked for, :func:`plan_layer` says what one layer keeps
(:class:`LayerPlan`: grouped-query padding with zero-output heads, or an emptied layer), and for a model
sharded by tensor parallelism :func:`check_balanced` refuses a plan that would leave the ranks holding
unequal heads (:func:`balanced_removal` finds a balanced one to suggest). Nothing here touches a module:
the cut is :mod:`headlab.models.surgery`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import headlab.checks as checks
from headlab.errors import ConfigError, PruneError
from headlab.models.base import ModelAdapter


@dataclass(frozen=True)
class LayerPlan:
    """What one layer keeps, in original head indices (ascending)."""

    q: tuple[int, ...]  # query heads kept, zero-output padding included
    kv: tuple[int, ...]  # KV heads kept (== q without GQA)
    zeroed: tuple[int, ...] = ()  # removed heads retained with W^O = 0 (GQA padding, or an emptied layer)

    @property
    def live(self) -> tuple[int, ...]:
        """Query heads that still contribute."""
        return tuple(h for h in self.q if h not in self.zeroed)


@dataclass
class LocalPlan:
    plan: LayerPlan  # in the indices of the model being cut

    @property
    def zeroed_local(self) -> list[int]:
        return [i for i, h in enumerate(self.plan.q) if h in self.plan.zeroed]


def check_heads(adapter: ModelAdapter, heads: dict) -> dict[int, list[int]]:
    """Validate ``{layer: [head, ...]}``: ints in range, no duplicates. Returns a clean copy."""
    if not isinstance(heads, dict):
        raise ConfigError(f"heads to prune must be a dict {{layer: [head, ...]}}, got {type(heads).__name__}")
    clean: dict[int, list[int]] = {}
    for layer, hs in heads.items():
        checks.index(
            "layer",
            layer,
            adapter.n_layers,
            negative=False,
            message="layer {value!r} out of range: the model has {length} layers (0..{high})",
        )
        hs = [hs] if isinstance(hs, int) else list(hs)
        n = adapter.layer_heads[layer]
        for h in hs:
            checks.index(
                "head",
                h,
                n,
                negative=False,
                message=f"head {{value!r}} of layer {layer} out of range: that layer has {{length}} heads "
                "(0..{high})",
            )
        if len(set(hs)) != len(hs):
            raise ConfigError(f"layer {layer}: head listed twice in {hs}")
        clean[layer] = sorted(hs)
    return clean


def plan_layer(
    H: int, Hkv: int, removed: list[int], *, layer: int, allow_empty_layers: bool, gqa: Literal["pad", "strict"]
) -> tuple[LayerPlan, str | None]:
    """The kept heads of one layer with ``H`` query and ``Hkv`` KV heads after removing ``removed``."""
    G = H // Hkv
    kept = [h for h in range(H) if h not in set(removed)]
    if not kept:
        if not allow_empty_layers:
            raise PruneError(
                f"pruning every head of layer {layer} ({H} heads): the layer's attention would output "
                "only W^O's bias; pass allow_empty_layers=True (CLI --allow-empty-layers) if you mean it"
            )
        return LayerPlan(q=(0,), kv=(0,), zeroed=(0,)), (
            f"layer {layer}: every head pruned; its attention now outputs only W^O's bias "
            "(head 0 kept with W^O = 0 so that the module still runs)"
        )
    groups: dict[int, list[int]] = {}
    for h in kept:
        groups.setdefault(h // G, []).append(h)
    sizes = {g: len(v) for g, v in groups.items()}
    target = max(sizes.values())
    zeroed: list[int] = []
    note = None
    if len(set(sizes.values())) > 1:
        if gqa == "strict":
            raise PruneError(
                f"layer {layer}: grouped-query attention with {G} query heads per KV head; this pruning leaves "
                f"groups of {[sizes[g] for g in sorted(sizes)]} query heads (KV heads {sorted(sizes)}), which the "
                "kernels cannot run exactly; prune whole groups, or use gqa='pad' (keeps the removed heads a "
                "group needs, with W^O = 0)"
            )
        for g, members in groups.items():
            spare = [h for h in range(g * G, (g + 1) * G) if h not in members]
            zeroed += spare[: target - len(members)]
        note = (
            f"layer {layer}: uneven GQA groups {[sizes[g] for g in sorted(sizes)]}; kept {len(zeroed)} removed "
            f"head(s) {sorted(zeroed)} as zero-output padding (W^O = 0) so that every group holds {target}"
        )
    q = tuple(sorted(kept + zeroed))
    return LayerPlan(q=q, kv=tuple(sorted(groups)), zeroed=tuple(sorted(zeroed))), note


def _shares(plan: LayerPlan, tp) -> list[tuple[int, int]]:
    """``(query heads, kv heads)`` each rank keeps of one layer's plan (global indices)."""
    return [
        (sum(h in tp.heads(r) for h in plan.q), sum(g in tp.kv_heads(r) for g in plan.kv))
        for r in range(tp.tensor_size)
    ]


def check_balanced(plans: list[LayerPlan], tp, asked: dict[int, list[int]]) -> None:
    """Refuse a pruning of a sharded model that would leave the ranks (or the layers) holding unequal heads.

    transformers' plan cuts each projection into equal row blocks, and headlab reads a sharded model whose every
    layer holds ``H / world`` query and ``Hkv / world`` kv heads on each rank; so every rank must remove the same
    number of its heads in every layer (kv heads go with their last query head, as in one process). The error
    names what each rank would keep and a removal that would be balanced."""
    shares = [_shares(p, tp) for p in plans]
    if len({s for layer in shares for s in layer}) == 1:
        return
    where = "; ".join(
        f"layer {l}: " + ", ".join(f"rank {r} {q}q/{kv}kv" for r, (q, kv) in enumerate(s)) for l, s in enumerate(shares)
    )
    found = balanced_removal(tp, asked, plans)
    hint = (f"e.g. {found}" if found is not None else "whole kv groups of each rank") + " (gqa='pad')"
    raise PruneError(
        f"pruning this model, sharded over {tp.tensor_size} ranks, would leave unequal shards ({where}; query/kv "
        f"heads kept): each rank holds {tp.local_heads} query heads of every layer (rank 0 {list(tp.heads(0))}, "
        "...), and transformers' plan and headlab's reading of it need every rank of every layer to keep as many query and kv "
        f"heads as the others; remove the same number of each rank's heads in every layer, {hint}, or prune in one "
        "process (headlab.load without tensor_parallel)"
    )


def balanced_removal(tp, asked: dict[int, list[int]], plans: list[LayerPlan]) -> dict[int, list[int]] | None:
    """A removal close to ``asked`` that keeps the shards even: in every layer, each rank removes ``k`` of its heads,
    ``k`` the most any rank removes anywhere in ``asked`` (at most all but one), its asked heads first, then its
    next ones. None when that is not balanced either (uneven GQA groups)."""
    k = max(
        (sum(h in tp.heads(r) for h in asked.get(l, [])) for l in range(len(plans)) for r in range(tp.tensor_size)),
        default=0,
    )
    k = min(k, tp.local_heads - 1)
    out: dict[int, list[int]] = {}
    for l in range(len(plans)):
        chosen: list[int] = []
        for r in range(tp.tensor_size):
            mine = [h for h in asked.get(l, []) if h in tp.heads(r)][:k]
            mine += [h for h in tp.heads(r) if h not in mine][: k - len(mine)]
            chosen += sorted(mine)
        if chosen:
            out[l] = chosen
    ok = (
        [
            plan_layer(tp.n_heads, tp.n_kv_heads, out.get(l, []), layer=l, allow_empty_layers=False, gqa="pad")[0]
            for l in range(len(plans))
        ]
        if out
        else []
    )
    return out if ok and len({s for p in ok for s in _shares(p, tp)}) == 1 else None
