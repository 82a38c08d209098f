"""A model sharded by tensor parallelism: which heads each rank holds, and one view in global head order.

headlab does not shard models itself: transformers does, with the family's own plan (``DistributedConfig(
tp_plan="auto")``, what ``headlab.load(..., tensor_parallel=True)`` passes). Its ``colwise`` style cuts
q_proj, k_proj and v_proj by rows (output features) and its ``rowwise`` style cuts o_proj by columns (input
features), each weight a ``DTensor`` on a 1-D device mesh; the attention module then runs on this rank's slice
alone. Everything headlab needs to know about that lives here, read from the sharded weights themselves:

- :class:`HeadShards`: rank ``r`` of ``world`` holds query heads ``[r*H/world, (r+1)*H/world)`` and kv heads
  ``[r*Hkv/world, (r+1)*Hkv/world)`` (the offset of each shard is read from its ``DTensor``, not assumed);
  :meth:`HeadShards.gather` puts a site's per-rank tensors back in global head order (an all-gather on the
  mesh's process group, the default group for a plain ``torchrun``).
- :func:`shards_of`: the adapter's :class:`HeadShards`, or None for a model that is not sharded (the adapter
  asks once, in :class:`~headlab.models.base.ModelAdapter`'s constructor).
- :func:`check_before_load`: the refusals that need only the config (no plan in transformers for the family,
  a world size that does not divide the query or the kv heads), made before any weight is read.
- :func:`gate_hook`, :func:`head_out_hook`: the two W^O hooks of a sharded layer (this rank's heads, the gates of
  their global indices, this rank's slice of W^O).
- Edits address global heads and land on the owning rank, two ways (:func:`global_edit` picks): a plain edit
  ``fn(t, site)`` sees the whole site in global head order (an all-gather) and the rank keeps its slice of the
  result; a :class:`by_heads` edit ``fn(t, site, heads)`` treats each head by itself and is handed only this
  rank's heads with their global indices (no communication, and gradients flow through it: importance,
  ablation and patching edit this way).
- :func:`study_examples`, :func:`sum_heads`: what a study that adds over examples does under tensor
  parallelism (every rank of a tensor-parallel group runs the same examples, split across the groups of a 2-D
  mesh: :mod:`headlab.models.tp_mesh`; each head's sum is made on its owner and added over the ranks).

Under tensor parallelism every rank must make the same calls (a capture, an edit) in the same order: the
gathers are collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from headlab.distributed.comm import talking
from headlab.errors import ConfigError, DistributedError, ShapeError, UnsupportedArchitectureError
from headlab.models import tp_mesh  # data x tensor parallelism: which examples a rank runs, and the sums
from headlab.models.sites import LayerState, visit

Q_KINDS = ("q", "pattern", "z", "head_out")  # sites whose axis 1 is the query heads
KV_KINDS = ("k", "v")  # sites whose axis 1 is the kv heads
STATS_FIELDS = ("lse", "entropy", "max_weight", "argmax", "mean_distance", "key_mass", "received", "rows",
                "output", "visible")  # AttentionStats fields with a head axis (axis 1)


@dataclass(frozen=True)
class HeadShards:
    """This rank's share of every attention layer (uniform over layers, as transformers' plans shard them).

        >>> s = HeadShards(rank=1, world=2, n_heads=4, n_kv_heads=2)
        >>> list(s.heads()), list(s.kv_heads()), s.global_index(0), s.owner(3)
        ([2, 3], [1], 2, (1, 1))
    """

    rank: int  # this process's index in the tensor-parallel group
    world: int  # ranks in the group
    n_heads: int  # query heads of the whole model (H)
    n_kv_heads: int  # kv heads of the whole model (Hkv)
    group: Any = None  # the process group of the tensor-parallel mesh

    @property
    def local_heads(self) -> int:
        """Query heads on each rank: ``H // world``."""
        return self.n_heads // self.world

    @property
    def local_kv_heads(self) -> int:
        return self.n_kv_heads // self.world

    def heads(self, rank: int | None = None) -> range:
        """Global indices of the query heads ``rank`` (default: this one) holds, in its local order."""
        r = self.rank if rank is None else rank
        return range(r * self.local_heads, (r + 1) * self.local_heads)

    def kv_heads(self, rank: int | None = None) -> range:
        r = self.rank if rank is None else rank
        return range(r * self.local_kv_heads, (r + 1) * self.local_kv_heads)

    def global_index(self, local: int, rank: int | None = None) -> int:
        """The global index of local query head ``local`` of ``rank``."""
        return self.heads(rank)[local]

    def owner(self, head: int) -> tuple[int, int]:
        """``(rank, local index)`` of global query head ``head``."""
        return divmod(int(head), self.local_heads)

    def heads_of(self, kind: str) -> range:
        """Global indices of what axis 1 of this rank's ``kind`` holds: query heads, or kv heads for k and v."""
        return self.kv_heads() if kind in KV_KINDS else self.heads()

    def gather(self, t: torch.Tensor, kind: str, to: str = "all") -> torch.Tensor | None:
        """``t`` (this rank's heads on axis 1) from every rank, concatenated in global head order: on every rank
        (``to="all"``, an all-gather), or on rank 0 alone (``to="rank0"``, a gather; the others get None).
        Sites without a head axis come back as they are."""
        if kind not in Q_KINDS + KV_KINDS or self.world == 1:
            return t
        if t.dtype == torch.bool:  # not every backend gathers booleans (the stats' ``visible``)
            got = self.gather(t.to(torch.uint8), kind, to)
            return None if got is None else got.bool()
        t = t.detach().contiguous()
        if to == "rank0":
            parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
            with talking(f"the tensor-parallel gather of {kind!r} to rank 0", self.rank):
                dist.gather(t, parts, group=self.group, group_dst=0)
            return None if parts is None else torch.cat(parts, dim=1)
        parts = [torch.empty_like(t) for _ in range(self.world)]
        with talking(f"the tensor-parallel all-gather of {kind!r}", self.rank):
            dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=1)

    def local(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        """This rank's slice (axis 1) of a tensor in global head order."""
        if kind not in Q_KINDS + KV_KINDS:
            return t
        r = self.heads() if kind in Q_KINDS else self.kv_heads()
        return t[:, r.start:r.stop]

    def gather_sites(self, data: dict[str, object], to: str = "all") -> dict[str, object]:
        """A capture's ``{site: tensor}`` (this rank's heads) in global head order: on every rank (``to="all"``),
        or on rank 0 (``to="rank0"``: every other rank gets ``{}``). Every rank holds the same sites (they ran
        the same capture), so the gathers pair up; statistics (computed on each rank for its heads) are gathered
        field by field."""
        import dataclasses

        out: dict[str, object] = {}
        for name in sorted(data):  # the same order on every rank
            value, kind = data[name], name.rsplit(".", 1)[-1]
            if isinstance(value, torch.Tensor):
                out[name] = self.gather(value, kind, to)
            elif kind == "stats" and dataclasses.is_dataclass(value):
                got = {f: self.gather(getattr(value, f), "q", to) for f in STATS_FIELDS
                       if isinstance(getattr(value, f, None), torch.Tensor)}
                out[name] = dataclasses.replace(value, **got)
            else:
                out[name] = value
        if to == "rank0" and self.rank != 0:
            return {}
        return {name: out[name] for name in data}  # the capture's own order


def _placement_dim(t) -> int | None:
    """The sharded dimension of a 1-D-mesh DTensor (None when replicated), as a non-negative index."""
    (p,) = t.placements
    dim = getattr(p, "dim", None)
    return None if dim is None or not p.is_shard() else dim % t.ndim


def _offset(t) -> int:
    """The global offset of this rank's shard along its sharded dimension, read from the DTensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return off[_placement_dim(t)]


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "placements")


def shards_of(model: nn.Module, adapter) -> HeadShards | None:
    """The head shards of an adapted model, or None when its attention is not sharded.

    Every layer is checked on its weights: W^O cut by its input columns and every attention weight as wide as
    the query or kv heads cut by rows, on one 1-D mesh, each rank's slice starting at ``rank * rows / world``
    (read from the DTensor). Anything else is an :class:`UnsupportedArchitectureError` saying what was found."""
    weights = [getattr(op, "weight", None) for op in adapter.out_projs]
    if not any(_is_dtensor(w) for w in weights):
        return None
    H, Hkv, d = adapter.n_heads, adapter.n_kv_heads, adapter.head_dim
    fam = f"the {adapter.family!r} model"
    mesh = weights[0].device_mesh if _is_dtensor(weights[0]) else None
    if mesh is None or mesh.ndim != 1:
        raise UnsupportedArchitectureError(f"{fam} is sharded on a {getattr(mesh, 'ndim', '?')}-D device mesh; "
                                           "headlab reads tensor parallelism on a 1-D mesh only")
    rank, world = mesh.get_local_rank(), mesh.size()
    if len(set(adapter.layer_heads)) > 1 or H % world or Hkv % world:
        raise UnsupportedArchitectureError(f"{fam} has {H} query and {Hkv} kv heads per layer over {world} ranks: "
                                           "every layer's query and kv heads must split evenly across the ranks")
    for layer, (am, op, w) in enumerate(zip(adapter.attn_modules, adapter.out_projs, weights)):
        if not _is_dtensor(w) or _placement_dim(w) != w.ndim - 1 or w.shape[-1] != H * d:
            how = getattr(w, "placements", "not sharded")
            raise UnsupportedArchitectureError(
                f"{fam}: layer {layer}'s output projection is {how}, not cut by the heads' columns (transformers' "
                "'rowwise' style): this family's tensor-parallel plan does not keep whole heads on each rank")
        if _offset(w) != rank * H * d // world:
            raise UnsupportedArchitectureError(f"{fam}: layer {layer}'s W^O shard on rank {rank} starts at column "
                                               f"{_offset(w)}, not {rank * H * d // world}")
        outs = {id(p) for p in op.parameters()}  # W^O may sit inside the attention module (o_proj)
        cut = [(n, p) for n, p in am.named_parameters()
               if id(p) not in outs and p.ndim == 2 and p.shape[0] in (H * d, Hkv * d)]
        if not cut:
            raise UnsupportedArchitectureError(f"{fam}: layer {layer}'s attention has no query/key/value weights "
                                               "this adapter recognises as cut by heads")
        for n, p in cut:
            if not _is_dtensor(p) or _placement_dim(p) != 0 or _offset(p) != rank * p.shape[0] // world:
                raise UnsupportedArchitectureError(
                    f"{fam}: layer {layer}'s {n} is {getattr(p, 'placements', 'not sharded')}, not cut by rows "
                    "into whole heads in rank order (transformers' 'colwise' style)")
    return HeadShards(rank=rank, world=world, n_heads=H, n_kv_heads=Hkv, group=mesh.get_group())


def check_before_load(config, world: int) -> None:
    """Refuse, from the config alone, a model transformers cannot shard by heads over ``world`` ranks."""
    mt = getattr(config, "model_type", "?")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise UnsupportedArchitectureError(
            f"model type {mt!r} has no tensor-parallel plan in transformers (its config's base_model_tp_plan is "
            "empty), so it cannot be sharded by heads; load it without tensor_parallel")
    from headlab.models.hf.registry import adapter_class  # the families headlab declares (the loader imported them)
    if adapter_class(mt) is None:  # read by structure: discovery probes a rank's H/world heads as the config's H
        raise UnsupportedArchitectureError(
            f"model type {mt!r} has a tensor-parallel plan, but no headlab family class declares it: headlab reads it "
            "by structure, and that discovery takes one rank's H/world heads for all H; load it without "
            "tensor_parallel, or declare its family (headlab.models.hf)")
    H = getattr(text, "num_attention_heads", None)
    Hkv = getattr(text, "num_key_value_heads", None) or H
    if H is None:
        raise UnsupportedArchitectureError(f"cannot read the query heads of a {mt!r} config")
    if H % world:
        raise ConfigError(f"tensor parallelism over {world} ranks: the model has {H} query heads, which {world} does "
                          f"not divide; use a world size that divides {H}")
    if Hkv % world:
        raise ConfigError(
            f"tensor parallelism over {world} ranks: the model has {Hkv} key/value heads, which {world} does not "
            "divide; transformers' plan cuts k_proj and v_proj into equal row blocks, so a kv head would be split "
            f"across ranks (it does not replicate kv heads); use at most {Hkv} ranks, a divisor of {Hkv}")


def world_size() -> int:
    """Ranks of the run: the default process group's, else torchrun's ``WORLD_SIZE``; DistributedError outside
    torchrun."""
    import os

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    raise DistributedError("tensor_parallel=True needs several processes: launch with torchrun "
                           "(torchrun --nproc_per_node N script.py) or call torch.distributed.init_process_group first")


# -- the two W^O hooks of a sharded layer (the unsharded ones are headlab.models.sites.gate_hook / head_out_hook) --
def gate_hook(module: nn.Module, args: tuple):
    """Pre-hook on a row-parallel W^O: its input is this rank's heads ``(B, L, H/world*d)``; split, report z, apply
    the gates of these heads' global indices, join again."""
    x = args[0]
    state: LayerState = module._headlab
    tp: HeadShards = state.adapter.tp
    H, d = state.n_heads, state.head_dim  # local heads
    lead = x.shape[:-1]
    z = visit(state, "z", x.reshape(*lead, H, d).movedim(-2, -3))  # (B, H_local, L, d)
    heads = tp.heads()
    g = state.adapter.gates[state.layer, heads.start:heads.stop].to(device=z.device, dtype=z.dtype).view(H, 1, 1)
    zg = z * g
    state.z_gated = zg if state.wants("head_out") else None
    return (zg.movedim(-3, -2).reshape(*lead, H * d), *args[1:])


def local_W_O(module: nn.Module, n_local: int, head_dim: int) -> torch.Tensor:
    """This rank's heads' blocks of a row-parallel ``nn.Linear`` W^O: ``(H/world, d, E)``."""
    w = module.weight
    w = w.to_local() if _is_dtensor(w) else w  # (E, H/world*d)
    return w.detach().t().reshape(n_local, head_dim, -1)


def head_out_hook(module: nn.Module, args: tuple, output: torch.Tensor):
    """Hook on a row-parallel W^O: head_out for this rank's heads; when edited (or its gradient is wanted), the
    output is rebuilt as the sum over every rank's heads (an all-reduce, as the row-parallel layer does) plus the bias."""
    state: LayerState = module._headlab
    zg, state.z_gated = state.z_gated, None
    if zg is None:
        return None
    tp: HeadShards = state.adapter.tp
    W = local_W_O(module, state.n_heads, state.head_dim).to(zg.dtype)
    head_out = visit(state, "head_out", torch.einsum("bhld,hde->bhle", zg, W))  # (B, H_local, L, E)
    if not state.edits.get("head_out") and not (state.probe is not None and state.probe.grads):
        return None  # rebuilt only when edited or when its gradient is wanted (then it must be in the graph)
    new = head_out.sum(-3).contiguous()
    with talking("the tensor-parallel all-reduce of an edited head_out", tp.rank):
        dist.all_reduce(new, group=tp.group)
    b = getattr(module, "bias", None)
    b = b.to_local() if _is_dtensor(b) else b
    return new if b is None else new + b


def hooks_for(adapter) -> tuple[Callable, Callable] | None:
    """The W^O hooks of a sharded adapter (None: the adapter is not sharded; use the unsharded ones)."""
    return (gate_hook, head_out_hook) if getattr(adapter, "tp", None) is not None else None


class by_heads:
    """An edit that treats each head by itself: ``fn(t, site, heads) -> t``, where axis 1 of ``t`` holds the heads
    whose global indices are ``heads`` (a range: query heads, or kv heads at ``k`` and ``v``). Unsharded, ``heads``
    is every head of the layer; under tensor parallelism each rank is handed its own heads, so a per-head table
    indexed by global head (a mask, gates, a patch source) is sliced with ``heads`` and nothing moves between
    ranks. Use it wherever an edit is a plain edit ``fn(t, site)``:

        >>> import torch
        >>> zero_3 = by_heads(lambda z, site, heads: z * (torch.tensor(heads) != 3).view(1, -1, 1, 1))
        >>> zero_3(torch.ones(1, 4, 2, 8), "blocks.0.attn.z")[0, :, 0, 0].tolist()
        [1.0, 1.0, 1.0, 0.0]
    """

    def __init__(self, fn: Callable[[torch.Tensor, str, range], torch.Tensor]) -> None:
        self.fn = fn

    def __call__(self, t: torch.Tensor, site: str) -> torch.Tensor:
        return self.fn(t, site, range(t.shape[1]))


def global_edit(adapter, fn: Callable, kind: str) -> Callable:
    """``fn`` as an edit of a sharded site, landing on the ranks that own the heads it changes.

    A :class:`by_heads` edit is handed this rank's heads and their global indices. Any other ``fn`` is given
    the whole site in global head order (gathered) and this rank keeps its slice of what it returns; ``fn`` must
    then give the same result on every rank (no randomness), and no gradient flows through the gather. Sites
    without a head axis (the residual stream, replicated on every rank) are edited as they are."""
    tp: HeadShards | None = getattr(adapter, "tp", None)
    if tp is None or kind not in Q_KINDS + KV_KINDS:
        return fn
    if isinstance(fn, by_heads):
        heads = tp.heads_of(kind)
        return lambda t, site: fn.fn(t, site, heads)

    def edit(t: torch.Tensor, site: str) -> torch.Tensor:
        full = tp.gather(t, kind)
        new = fn(full, site)
        if isinstance(new, torch.Tensor) and new.shape != full.shape:
            raise ShapeError(f"the edit of {site} returned shape {tuple(new.shape)}; the site has shape "
                             f"{tuple(full.shape)} (all heads, in global order): return a tensor of the same shape")
        return tp.local(new, kind) if isinstance(new, torch.Tensor) else new

    return edit


# -- studies that add over examples (importance, confidence): every rank runs every example under tensor parallelism
def study_examples(adapter, n: int) -> list[int]:
    """The examples (of ``n``) this rank runs: on a sharded model its tensor-parallel group's share (all of them with
    one group; every rank of a group makes the same forwards), else this data-parallel rank's (``shard_indices``)."""
    from headlab.distributed.data import shard_indices

    tp: HeadShards | None = getattr(adapter, "tp", None)
    if tp is None:
        return shard_indices(n)
    return tp_mesh.examples(tp, n)  # all n with one tensor-parallel group; a data rank's share on a 2-D mesh


def data_rank(adapter) -> int:
    """This rank's index among the ranks that split the examples (on a sharded model: its group's index)."""
    from headlab.distributed.comm import world

    return tp_mesh.data_rank(adapter.tp) if getattr(adapter, "tp", None) is not None else world()[0]


def sum_heads(adapter, t: torch.Tensor) -> torch.Tensor:
    """Sums of a study, ``(..., n_heads)`` per head, added over the ranks: on a sharded model each rank holds its
    own heads' sums (zeros elsewhere) and they are added over the tensor-parallel group; else the data-parallel
    ranks' sums are added (:func:`~headlab.distributed.data.all_reduce_sum`)."""
    from headlab.distributed.data import all_reduce_sum

    tp: HeadShards | None = getattr(adapter, "tp", None)
    return all_reduce_sum(t) if tp is None else tp_mesh.sum_heads(t, tp)


def sum_examples(adapter, parts: list) -> list[torch.Tensor]:
    """Sums over this rank's examples that every rank of a tensor-parallel group holds alike (a study computed from
    gathered, global-order captures: a probe's counts), added over the ranks that split the examples, as float64
    tensors: over every rank without tensor parallelism (:func:`~headlab.distributed.data.all_reduce_many`), over
    the data ranks (each group's copy once) on a sharded model."""
    from headlab.distributed.data import all_reduce_many

    tp: HeadShards | None = getattr(adapter, "tp", None)
    if tp is None:
        return all_reduce_many(parts)
    if tp_mesh.data_world(tp) == 1:
        return [torch.as_tensor(p, dtype=torch.float64) for p in parts]
    return [t / tp.world for t in all_reduce_many(parts)]  # every group's ranks added their (equal) sums


def full_weight(t: torch.Tensor) -> torch.Tensor:
    """A weight (or a view of one) as one tensor on every rank: a DTensor's ``full_tensor()`` (a collective:
    every rank calls it alike), a plain tensor itself."""
    return t.full_tensor() if _is_dtensor(t) else t


__all__ = ["HeadShards", "by_heads", "check_before_load", "data_rank", "full_weight", "sum_examples", "gate_hook", "global_edit",
           "head_out_hook", "hooks_for", "local_W_O", "shards_of", "study_examples", "sum_heads", "world_size"]
