"""What tensor parallelism costs each rank: weight, KV-cache and activation bytes, and what moves between ranks.

transformers shards a model with its family's plan, a table ``{module pattern: style}`` (``model.tp_plan``:
``"model.layers.*.self_attn.q_proj": "colwise"``, ...). A style says which dimension of each parameter is cut
(:data:`STYLES`); a parameter no pattern names is replicated, whole on every rank. torch cuts a dimension of
``n`` over ``world`` ranks into chunks of ``ceil(n / world)`` (the last ones shorter or empty), so rank ``r``
holds ``min(n, (r + 1) c) - min(n, r c)`` rows (:func:`local_size`). For a Llama-family plan over ``w`` ranks:

- attention: q/k/v cut by rows (``colwise``: this rank's query and kv heads), W^O by columns (``rowwise``, its
  bias replicated): ``1 / w`` of every attention weight;
- MLP: gate/up by rows, down by columns: ``1 / w``;
- embeddings: ``embedding_rowwise`` cuts the vocabulary; ``lm_head`` ``colwise_gather_output`` cuts it too;
- norms (and anything else no pattern names): replicated.

:func:`weight_bytes` adds this up from the parameters' global shapes (a model built on the ``meta`` device gives
them without allocating) and is what :func:`headlab.load` asks before loading with ``tensor_parallel=True``.

    >>> plan = {"layers.*.attn.q": "colwise", "layers.*.attn.o": "rowwise"}
    >>> shapes = {"layers.0.attn.q.weight": (64, 32), "layers.0.attn.o.weight": (32, 64), "layers.0.attn.o.bias": (32,),
    ...           "layers.0.norm.weight": (32,)}
    >>> w = weight_bytes(shapes, plan, world=2, rank=0, itemsize=4)
    >>> w.sharded, w.replicated, w.total           # 32x32 + 32x32 cut; o's bias and the norm whole
    (8192, 256, 8448)

What headlab's own reading of a sharded model moves (the model's own all-reduces are the model's, the same with or
without headlab): a capture's site with a head axis holds ``bytes / w`` on each rank; ``gather="all"`` all-gathers
it (each rank receives the ``w - 1`` other slices), ``gather="rank0"`` gathers it on rank 0 alone, ``"none"``
moves nothing (:func:`gather_bytes`). An exact patch gathers the corrupted run's patched sites to every rank once
and then edits each head on its owner, moving nothing more (:func:`patch_bytes`).

This module takes numbers and names, never a model: the layers above hand it shapes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from headlab.errors import ConfigError

__all__ = [
    "STYLES",
    "TPWeights",
    "activation_bytes",
    "gather_bytes",
    "kv_cache_bytes_per_rank",
    "local_size",
    "patch_bytes",
    "plan_style",
    "site_bytes",
    "weight_bytes",
]

# which dimension of a weight (2-D) and of a bias (1-D) each transformers style cuts; None: replicated
STYLES: dict[str, tuple[int | None, int | None]] = {
    "colwise": (0, 0),
    "colwise_gather_output": (0, 0),
    "colwise_rep": (0, 0),
    "rowwise": (1, None),
    "rowwise_split_input": (1, None),
    "rowwise_rep": (1, None),
    "embedding_rowwise": (0, None),
    "embedding_colwise": (1, None),
    "replicate": (None, None),
    "sequence_parallel": (None, None),
    "replicated_with_grad_allreduce": (None, None),
}
Q_SITES = ("q", "z", "head_out", "pattern")  # sites whose axis 1 is the query heads
KV_SITES = ("k", "v")


def _check_world(world: int, rank: int = 0) -> None:
    if not isinstance(world, int) or world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} of a world of {world}: give a world of at least 1 and 0 <= rank < world")


def local_size(n: int, world: int, rank: int) -> int:
    """Rows of a dimension of ``n`` that rank ``rank`` of ``world`` holds when torch shards it (``Shard(dim)``).

    >>> [local_size(10, 4, r) for r in range(4)]
    [3, 3, 3, 1]
    """
    _check_world(world, rank)
    c = math.ceil(n / world)
    return min(n, (rank + 1) * c) - min(n, rank * c)


def _pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def plan_style(param: str, plan: Mapping[str, str]) -> str | None:
    """The style the plan gives parameter ``param`` (``a.b.weight``): its own entry, else its module's
    (``*`` matches a layer number); None when the plan does not name it (replicated)."""
    module = param.rpartition(".")[0]
    for name in (param, module):
        for key, style in plan.items():
            if _pattern(key).fullmatch(name):
                return style
    return None


def _group(name: str) -> str:
    """Which part of the model a parameter belongs to, by its name (for the report; the bytes do not depend on it)."""
    low = name.lower()
    if (
        "norm" in ([""] + low.split("."))[-2] or ".ln" in low
    ):  # the module's own name: post_attention_layernorm is a norm
        return "norms"
    if any(k in low for k in ("attn", "attention")):
        return "attention"
    if any(k in low for k in ("mlp", "feed_forward", "ffn")):
        return "mlp"
    if any(k in low for k in ("embed", "lm_head", "wte", "wpe")):
        return "embeddings"
    return "other"


@dataclass(frozen=True)
class TPWeights:
    """One rank's parameter bytes under a plan: cut by the plan, replicated, and by part of the model."""

    rank: int
    world: int
    sharded: int  # bytes of this rank's slices of the parameters the plan cuts
    replicated: int  # bytes of the parameters every rank holds whole
    by_group: dict[str, int] = field(default_factory=dict)  # attention, mlp, embeddings, norms, other
    by_param: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def weight_bytes(
    shapes: Mapping[str, Sequence[int]],
    plan: Mapping[str, str],
    *,
    world: int,
    rank: int = 0,
    itemsize: int | Mapping[str, int] = 4,
) -> TPWeights:
    """Parameter bytes rank ``rank`` holds when ``plan`` shards parameters of global ``shapes`` over ``world``.

    ``itemsize``: bytes per number, one for all or per parameter. A style this module does not know is a
    :class:`~headlab.errors.ConfigError` (never a guess)."""
    _check_world(world, rank)
    sharded = replicated = 0
    groups: dict[str, int] = {}
    per: dict[str, int] = {}
    for name, shape in shapes.items():
        shape = tuple(int(s) for s in shape)
        size = itemsize[name] if isinstance(itemsize, Mapping) else itemsize
        style = plan_style(name, plan) if world > 1 else None
        if style is not None and style not in STYLES:
            raise ConfigError(
                f"the plan gives {name} the style {style!r}, which the cost model does not know; "
                f"known styles: {', '.join(sorted(STYLES))}"
            )
        dim = None if style is None else STYLES[style][0 if len(shape) >= 2 else 1]
        n = math.prod(shape)
        if dim is None:
            b = n * size
            replicated += b
        else:
            d = dim if dim < len(shape) else len(shape) - 1
            b = n // shape[d] * local_size(shape[d], world, rank) * size if shape[d] else 0
            sharded += b
        per[name] = b
        groups[_group(name)] = groups.get(_group(name), 0) + b
    return TPWeights(rank, world, sharded, replicated, groups, per)


def kv_cache_bytes_per_rank(
    policy,
    *,
    kv_heads: Sequence[int],
    world: int,
    tokens: int,
    head_dim: int,
    dtype="float32",
    v_dim: int | None = None,
    prompt: int | None = None,
) -> list[int]:
    """What each rank's per-head KV cache holds after ``tokens`` tokens (``prompt`` of them the prefill): a kv head's
    keys and values live on the rank that holds it (rank ``r`` holds kv heads ``[r g / w, (r + 1) g / w)`` of a
    layer with ``g``). ``policy``: a :class:`headlab.kv.Policy` (its ``layouts``, or ``kept``); the entries add up to
    :func:`headlab.costs.kv.policy_cache_bytes`, the one-process cache."""
    from headlab.costs.kv import kv_cache_bytes, layout_bytes

    _check_world(world)
    kvh = list(kv_heads)
    for g in kvh:
        if g % world:
            raise ConfigError(f"{g} kv heads over {world} ranks: a kv head cannot be split across ranks")
    if hasattr(policy, "layouts"):
        per = [
            [layout_bytes(lay, head_dim=head_dim, dtype=dtype, v_dim=v_dim) for lay in layer]
            for layer in policy.layouts(tokens, kvh, prompt)
        ]
    else:
        per = [
            [kv_cache_bytes([[n]], head_dim=head_dim, dtype=dtype, v_dim=v_dim) for n in layer]
            for layer in policy.kept(tokens, kvh)
        ]
    out = [0] * world
    for g, layer in zip(kvh, per):
        for j, b in enumerate(layer):
            out[j // (g // world)] += b
    return out


def site_bytes(
    kind: str,
    *,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    d_model: int,
    itemsize: int,
    world: int = 1,
) -> int:
    """Bytes of one layer's capture site on one rank (``world`` ranks each holding ``1 / world`` of the heads):
    q and z ``(B, H/w, L, d)``, k and v ``(B, Hkv/w, L, d)``, pattern ``(B, H/w, L, L)``, head_out
    ``(B, H/w, L, E)``; a residual site ``(B, L, E)`` is whole on every rank."""
    h, hkv = heads // world, kv_heads // world
    per = {
        "q": h * seq * head_dim,
        "z": h * seq * head_dim,
        "k": hkv * seq * head_dim,
        "v": hkv * seq * head_dim,
        "pattern": h * seq * seq,
        "head_out": h * seq * d_model,
    }
    if kind.startswith("resid") or kind in ("attn_out", "mlp_out"):
        return batch * seq * d_model * itemsize
    if kind not in per:
        raise ConfigError(f"no size for the site kind {kind!r}; known: {', '.join(per)}, resid_*")
    return batch * per[kind] * itemsize


def gather_bytes(local: int, *, world: int, to: str = "all") -> list[int]:
    """Bytes each rank receives when a head site holding ``local`` bytes per rank is gathered: ``"all"`` (an
    all-gather: every rank receives the other ``world - 1`` slices), ``"rank0"`` (rank 0 receives them, the others
    nothing) or ``"none"`` (kept where it is)."""
    if to not in ("all", "rank0", "none"):
        raise ConfigError(f"gather={to!r}: give 'all', 'rank0' or 'none'")
    _check_world(world)
    if to == "none" or world == 1:
        return [0] * world
    other = (world - 1) * local
    return [other] * world if to == "all" else [other] + [0] * (world - 1)


def activation_bytes(kinds: Sequence[str], *, layers: int, world: int, to: str = "all", **shape) -> dict[str, list]:
    """A capture of site ``kinds`` in every one of ``layers`` layers: ``held`` (bytes each rank holds after the
    capture: the whole sites with ``"all"``, on rank 0 with ``"rank0"``, its slices with ``"none"``) and ``moved``
    (bytes each rank receives). ``shape``: :func:`site_bytes`' keywords other than ``world``."""
    _check_world(world)
    held, moved = [0] * world, [0] * world
    for kind in kinds:
        local = site_bytes(kind, world=world, **shape)
        whole = kind.startswith("resid") or kind in ("attn_out", "mlp_out")
        got = [0] * world if whole else gather_bytes(local, world=world, to=to)
        for r in range(world):
            if to == "rank0" and r != 0:
                continue  # the other ranks' capture comes back empty
            held[r] += layers * (local + got[r])
            moved[r] += layers * got[r]
    return {"held": held, "moved": moved}


def patch_bytes(kinds: Sequence[str], *, layers: int, world: int, **shape) -> list[int]:
    """Bytes each rank receives for an exact patch of site ``kinds`` over ``layers`` layers: the corrupted run's
    sites are all-gathered once (head sites; a residual site is already whole everywhere); the patched runs then
    edit each head on its owner, from its slice, and move nothing more."""
    kinds = [k for k in kinds if not (k.startswith("resid") or k in ("attn_out", "mlp_out"))]
    return activation_bytes(kinds, layers=layers, world=world, to="all", **shape)["moved"]
