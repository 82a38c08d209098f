"""Tensor parallelism for a model read by structure: the shard plan from the projections found, or the config's own.

A declared family is sharded by transformers while it loads (``DistributedConfig(tp_plan="auto")``), with the
family's plan, and its adapter takes ``H`` from the config. A type no family declares is read by structure
(:mod:`headlab.models.hf.structure`), and discovery on a sharded model would see one rank's ``H / T`` heads as the
model's. So such a model is loaded whole on every rank, read and checked there, exactly as in one process (the
discovery and the load-time check are one process's arithmetic on the same weights), and only then cut by heads
(:func:`shard_by_structure`) with transformers' own sharding (``apply_tensor_parallelism``, its ``colwise`` and
``rowwise`` styles, on the tensor axis of a ``(data, tensor)`` mesh as :mod:`headlab.models.tp_mesh` lays it out):

==========================  ============================================================================
what was found              how it is cut (:func:`shard_plan`)
==========================  ============================================================================
separate q, k, v            each by output rows (``colwise``): rank ``r`` holds the rows of query heads
                            ``[r H/T, (r+1) H/T)`` and kv heads ``[r Hkv/T, (r+1) Hkv/T)``
fused, per head or grouped  the fused weight by output rows (``colwise``): ``(H, 3, d)`` and ``(Hkv, G+2, d)``
                            keep each head's (each group's) q, k and v together, so contiguous rows are whole heads
output projection W^O       by input columns (``rowwise``): this rank's heads' columns; the outputs are summed
                            over the ranks (an all-reduce), its bias added once
everything else             whole on every rank
==========================  ============================================================================

The config's own plan is taken instead when it has one that cuts the projections found that way (``colwise``
q/k/v, ``rowwise`` W^O: the MLP and the embeddings are then sharded too, as transformers shards them). The
attention module's integer attributes that count heads (those pruning updates: ``head_attrs``) are set to one
rank's counts, for modules that reshape with them rather than with ``-1``. The adapter is then built on the
sharded model as for a declared family: :func:`~headlab.models.tensor_parallel.placement_of` reads each rank's
heads from the sharded weights and checks that they are whole heads in rank order.

Refused, typed, before anything is cut: query or kv heads that ``T`` does not divide (the numbers named), a fused
``[Q|K|V]`` in blocks (a contiguous cut would split it by q, k and v rather than by heads), GPT-2's ``Conv1D``
(transformers' styles cut ``nn.Linear`` only), encoder-decoders, and a found layout whose projections are not
plain modules of the attention module. Each rank holds the whole model for a moment while it loads (as a 2-D
mesh load does: :func:`headlab.models.tp_mesh.load_sharded`); :func:`headlab.load` checks memory against that.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from headlab.errors import ConfigError, UnsupportedArchitectureError

__all__ = ["check_heads", "shard_by_structure", "shard_plan"]

LOCAL = {
    "H": lambda H, Hkv, d, T: H // T,
    "Hkv": lambda H, Hkv, d, T: Hkv // T,
    "G": lambda H, Hkv, d, T: H // Hkv,
    "H*d": lambda H, Hkv, d, T: H * d // T,
}


def check_heads(model_type: str, H: int, Hkv: int, T: int) -> None:
    """Refuse ``T`` ranks that do not divide the query or the kv heads (a :class:`ConfigError` naming the numbers)."""
    if H % T:
        raise ConfigError(
            f"tensor parallelism over {T} ranks: the {model_type!r} model has {H} query heads, which {T} does not "
            f"divide; use a world size that divides {H}"
        )
    if Hkv % T:
        raise ConfigError(
            f"tensor parallelism over {T} ranks: the {model_type!r} model has {Hkv} key/value heads, which {T} does "
            f"not divide; headlab keeps every head whole on one rank (a kv head is not split nor replicated), so "
            f"use at most {Hkv} ranks, a divisor of {Hkv}"
        )


def _names(model: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in model.named_modules()}


def shard_plan(model: Any, adapter) -> tuple[dict[str, str], str]:
    """``(plan, source)``: the plan that cuts ``adapter``'s projections by whole heads, expanded to one entry per
    module and parameter (what ``apply_tensor_parallelism`` takes), and ``"config"`` when it is the config's own
    plan or ``"structure"`` when derived from the projections found. UnsupportedArchitectureError for a layout
    that cannot be cut by heads."""
    mt = adapter.family
    if set(adapter.stacks) != {"blocks"}:
        raise UnsupportedArchitectureError(
            f"tensor parallelism for the {mt!r} encoder-decoder read by structure: headlab cuts one stack of "
            "blocks by heads, not an encoder, a decoder and their cross-attention; load it without tensor_parallel"
        )
    proj, out = adapter.projections, adapter.out
    if proj.conv1d or out.conv1d:
        raise UnsupportedArchitectureError(
            f"the {mt!r} model's attention projections are GPT-2 Conv1D modules (weight (in, out)); transformers' "
            "tensor-parallel styles cut nn.Linear only, so headlab cannot shard it by heads; load it without "
            "tensor_parallel"
        )
    if getattr(proj, "order", None) == "blocks":
        raise UnsupportedArchitectureError(
            f"the {mt!r} model computes q, k and v in one fused projection laid out [Q | K | V]; a cut of its rows "
            "into equal blocks would give a rank queries of some heads and keys of others, not whole heads; load it "
            "without tensor_parallel"
        )
    names = _names(model)
    want: dict[str, str] = {}
    for am, op in zip(adapter.attn_modules, adapter.out_projs):
        mods = {id(proj.module(am, w)): proj.module(am, w) for w in "qkv"}.values()
        for m in (*mods, op):
            if not isinstance(m, nn.Linear) or id(m) not in names:
                raise UnsupportedArchitectureError(
                    f"the {mt!r} model's attention projection {type(m).__name__} is not an nn.Linear of the model; "
                    "headlab cuts nn.Linear projections only; load it without tensor_parallel"
                )
        want.update({names[id(m)]: "colwise" for m in mods})
        want[names[id(op)]] = "rowwise"
    own = dict(getattr(model, "tp_plan", None) or {})
    if own:
        expanded = model._expand_parallel_plan(own)
        if all(expanded.get(n) == style for n, style in want.items()):
            return expanded, "config"
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard  # the plan's own keys

    mine = model._expand_parallel_plan({replace_layer_number_by_wildcard(n): s for n, s in want.items()})
    if any(mine.get(n) != style for n, style in want.items()):  # a path transformers' plan keys cannot name
        raise UnsupportedArchitectureError(f"the {mt!r} model's projections could not be named in a shard plan")
    return mine, "structure"


def _local_attrs(adapter, T: int) -> None:
    """Set the attention modules' head-count attributes (``head_attrs``) to one rank's counts."""
    H, Hkv, d = adapter.n_heads, adapter.n_kv_heads, adapter.head_dim
    for am in adapter.attn_modules:
        for attr, what in adapter.head_attrs.items():
            if isinstance(getattr(am, attr, None), int):
                setattr(am, attr, LOCAL[what](H, Hkv, d, T))


def shard_by_structure(model: nn.Module, *, tp_size: int, check: bool = True) -> str:
    """Read ``model`` (loaded whole on every rank) by structure, check it at load (``check``), and cut it by heads
    over groups of ``tp_size`` consecutive ranks of a ``(world / tp_size, tp_size)`` mesh, in place. Returns the
    plan's source (``"config"`` or ``"structure"``). Every rank must call it alike; the process group is started
    from torchrun's environment when none runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from headlab.distributed.data import init_from_env
    from headlab.models.hf.structure import adapt_by_structure

    adapter = adapt_by_structure(model, check=check)  # found and verified on the whole model, as one process
    try:
        check_heads(adapter.family, adapter.n_heads, adapter.n_kv_heads, tp_size)
        plan, source = shard_plan(model, adapter)
    finally:
        adapter.close()
    _, world = init_from_env()  # tp_size divides world: headlab.load checked it (TensorParallel.group_size)
    cuda = torch.cuda.is_available()
    if cuda:
        model.to(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world // tp_size, tp_size), mesh_dim_names=("data", "tp"))
    apply_tensor_parallelism(model, mesh["tp"], plan)
    _local_attrs(adapter, tp_size)
    return source
