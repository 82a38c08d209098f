"""A model sharded by tensor parallelism: which heads each rank holds, and one view in global head order.

headlab does not shard models itself: transformers does, with the family's own plan (``DistributedConfig(
tp_plan="auto")``, what ``headlab.load(..., tensor_parallel=True)`` passes). Its ``colwise`` style cuts
q_proj, k_proj and v_proj by rows (output features) and its ``rowwise`` style cuts o_proj by columns (input
features), each weight a ``DTensor`` on a 1-D device mesh; the attention module then runs on this rank's slice
alone. Everything headlab needs to know about that lives here, read from the sharded weights themselves:

- :func:`placement_of`: the adapter's :class:`~headlab.distributed.placement.Placement` when its attention is
  sharded (None otherwise; the adapter asks once, in :class:`~headlab.models.base.ModelAdapter`'s constructor), read
  from the sharded weights themselves: tensor rank ``r`` of ``T`` holds query heads ``[r*H/T, (r+1)*H/T)`` and kv
  heads ``[r*Hkv/T, (r+1)*Hkv/T)`` (the offset of each shard is read from its ``DTensor``, not assumed). The
  placement answers which heads a rank holds, gathers a site's per-rank tensors back in global head order (an
  all-gather on the mesh's process group) and makes the sums over the ranks.
- :func:`headlab.models.tp_mesh.check_before_load`: the refusals that need only the config (no plan in transformers for the family,
  a world size that does not divide the query or the kv heads), made before any weight is read.
- :func:`gate_hook`, :func:`head_out_hook`: the two W^O hooks of a sharded layer (this rank's heads, the gates of
  their global indices, this rank's slice of W^O).
- Edits address global heads and land on the owning rank, two ways (:func:`global_edit` picks): a plain edit
  ``fn(t, site)`` sees the whole site in global head order (an all-gather) and the rank keeps its slice of the
  result; a :class:`by_heads` edit ``fn(t, site, heads)`` treats each head by itself and is handed only this
  rank's heads with their global indices (no communication, and gradients flow through it: importance,
  ablation and patching edit this way).
- What a study that adds over examples does (which examples a rank runs, the sums over the ranks) is the
  placement's (``adapter.placement.examples(n)``, ``.sum_heads(t)``, ``.sum_over_data(parts)``);
  :func:`study_examples` and :func:`data_rank` keep two of its answers here by name, for scripts.

Under tensor parallelism every rank must make the same calls (a capture, an edit) in the same order: the
gathers are collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from headlab.distributed.comm import talking
from headlab.distributed.placement import KV_KINDS, Q_KINDS, Placement, is_dtensor
from headlab.errors import DistributedError, ShapeError, UnsupportedArchitectureError
from headlab.models.projections import Fused
from headlab.models.sites import LayerState, visit


def _placement_dim(t) -> int | None:
    """The sharded dimension of a 1-D-mesh DTensor (None when replicated), as a non-negative index."""
    (p,) = t.placements
    dim = getattr(p, "dim", None)
    return None if dim is None or not p.is_shard() else dim % t.ndim


def _offset(t) -> int:
    """The global offset of this rank's shard along its sharded dimension, read from the DTensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    dim = _placement_dim(t)
    assert dim is not None  # read of a sharded weight only
    return off[dim]


def placement_of(model: nn.Module, adapter) -> Placement | None:
    """The placement of an adapted model whose attention is sharded by heads, or None when it is not.

    Every layer is checked on its weights: W^O cut by its input columns and every attention weight as wide as
    the query or kv heads cut by rows, on one 1-D mesh, each rank's slice starting at ``rank * rows / world``
    (read from the DTensor). Anything else is an :class:`UnsupportedArchitectureError` saying what was found."""
    weights = [getattr(op, "weight", None) for op in adapter.out_projs]
    if not any(is_dtensor(w) for w in weights):
        return None
    H, Hkv, d = adapter.n_heads, adapter.n_kv_heads, adapter.head_dim
    fam = f"the {adapter.family!r} model"
    mesh = weights[0].device_mesh if is_dtensor(weights[0]) else None
    if mesh is None or mesh.ndim != 1:
        raise UnsupportedArchitectureError(
            f"{fam} is sharded on a {getattr(mesh, 'ndim', '?')}-D device mesh; "
            "headlab reads tensor parallelism on a 1-D mesh only"
        )
    rank, world = mesh.get_local_rank(), mesh.size()
    if len(set(adapter.layer_heads)) > 1 or H % world or Hkv % world:
        raise UnsupportedArchitectureError(
            f"{fam} has {H} query and {Hkv} kv heads per layer over {world} ranks: "
            "every layer's query and kv heads must split evenly across the ranks"
        )
    widths: tuple[int, ...] = (H * d, Hkv * d)
    proj = getattr(adapter, "projections", None)
    if isinstance(proj, Fused) and proj.order != "blocks":  # (H, 3, d) or (Hkv, G+2, d): row blocks are whole heads
        widths += ((H + 2 * Hkv) * d,)
    for layer, (am, op, w) in enumerate(zip(adapter.attn_modules, adapter.out_projs, weights)):
        if not is_dtensor(w) or _placement_dim(w) != w.ndim - 1 or w.shape[-1] != H * d:
            how = getattr(w, "placements", "not sharded")
            raise UnsupportedArchitectureError(
                f"{fam}: layer {layer}'s output projection is {how}, not cut by the heads' columns (transformers' "
                "'rowwise' style): this family's tensor-parallel plan does not keep whole heads on each rank"
            )
        if _offset(w) != rank * H * d // world:
            raise UnsupportedArchitectureError(
                f"{fam}: layer {layer}'s W^O shard on rank {rank} starts at column "
                f"{_offset(w)}, not {rank * H * d // world}"
            )
        outs = {id(p) for p in op.parameters()}  # W^O may sit inside the attention module (o_proj)
        cut = [(n, p) for n, p in am.named_parameters() if id(p) not in outs and p.ndim == 2 and p.shape[0] in widths]
        if not cut:
            raise UnsupportedArchitectureError(
                f"{fam}: layer {layer}'s attention has no query/key/value weights "
                "this adapter recognises as cut by heads"
            )
        for n, p in cut:
            if not is_dtensor(p) or _placement_dim(p) != 0 or _offset(p) != rank * p.shape[0] // world:
                raise UnsupportedArchitectureError(
                    f"{fam}: layer {layer}'s {n} is {getattr(p, 'placements', 'not sharded')}, not cut by rows "
                    "into whole heads in rank order (transformers' 'colwise' style)"
                )
    group = mesh.get_group()
    ranks = sorted(dist.get_process_group_ranks(group)) if dist.is_initialized() else list(range(world))
    if ranks != list(range(ranks[0], ranks[0] + world)) or ranks[0] % world:
        raise UnsupportedArchitectureError(
            f"the tensor-parallel group holds ranks {ranks}; headlab splits examples across groups of consecutive "
            f"ranks (a (data, tensor) mesh, the tensor axis last), as headlab.load(..., tensor_parallel=N) makes"
        )
    total = dist.get_world_size() if dist.is_initialized() else world
    return Placement(
        world=total, rank=ranks[0] + rank, tensor_size=world, n_heads=H, n_kv_heads=Hkv, sharded=True, group=group
    )


def world_size() -> int:
    """Ranks of the run: the default process group's, else torchrun's ``WORLD_SIZE``; DistributedError outside
    torchrun."""
    import os

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    raise DistributedError(
        "tensor_parallel=True needs several processes: launch with torchrun "
        "(torchrun --nproc_per_node N script.py) or call torch.distributed.init_process_group first"
    )


# -- the two W^O hooks of a sharded layer (the unsharded ones are headlab.models.sites.gate_hook / head_out_hook) --
def gate_hook(module: nn.Module, args: tuple):
    """Pre-hook on a row-parallel W^O: its input is this rank's heads ``(B, L, H/world*d)``; split, report z, apply
    the gates of these heads' global indices, join again."""
    x = args[0]
    state: LayerState = module._headlab  # type: ignore[assignment]  # torch types module attributes Tensor | Module
    H, d = state.n_heads, state.head_dim  # local heads
    lead = x.shape[:-1]
    z = visit(state, "z", x.reshape(*lead, H, d).movedim(-2, -3))  # (B, H_local, L, d)
    heads = state.adapter.placement.heads()
    g = state.adapter.gates[state.layer, heads.start : heads.stop].to(device=z.device, dtype=z.dtype).view(H, 1, 1)
    zg = z * g
    state.z_gated = zg if state.wants("head_out") else None
    return (zg.movedim(-3, -2).reshape(*lead, H * d), *args[1:])


def local_W_O(module: nn.Module, n_local: int, head_dim: int) -> torch.Tensor:
    """This rank's heads' blocks of a row-parallel ``nn.Linear`` W^O: ``(H/world, d, E)``."""
    w = module.weight
    w = Placement.to_local(w)  # (E, H/world*d)
    return w.detach().t().reshape(n_local, head_dim, -1)


def head_out_hook(module: nn.Module, args: tuple, output: torch.Tensor):
    """Hook on a row-parallel W^O: head_out for this rank's heads; when edited (or its gradient is wanted), the
    output is rebuilt as the sum over every rank's heads (an all-reduce, as the row-parallel layer does) plus the bias."""
    state: LayerState = module._headlab  # type: ignore[assignment]  # torch types module attributes Tensor | Module
    zg, state.z_gated = state.z_gated, None
    if zg is None:
        return None
    place: Placement = state.adapter.placement
    W = local_W_O(module, state.n_heads, state.head_dim).to(zg.dtype)
    head_out = visit(state, "head_out", torch.einsum("bhld,hde->bhle", zg, W))  # (B, H_local, L, E)
    if not state.edits.get("head_out") and not (state.probe is not None and state.probe.grads):
        return None  # rebuilt only when edited or when its gradient is wanted (then it must be in the graph)
    new = head_out.sum(-3).contiguous()
    with talking("the tensor-parallel all-reduce of an edited head_out", place.tensor_rank):
        dist.all_reduce(new, group=place.group)
    b = Placement.to_local(getattr(module, "bias", None))
    return new if b is None else new + b


def hooks_for(adapter) -> tuple[Callable, Callable] | None:
    """The W^O hooks of a sharded adapter (None: the adapter is not sharded; use the unsharded ones)."""
    return (gate_hook, head_out_hook) if adapter.placement.sharded else None


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
    tp: Placement = adapter.placement
    if not tp.sharded or kind not in Q_KINDS + KV_KINDS:
        return fn
    if isinstance(fn, by_heads):
        heads = tp.heads_of(kind)
        return lambda t, site: fn.fn(t, site, heads)

    def edit(t: torch.Tensor, site: str) -> torch.Tensor:
        full = tp.gather(t, kind)
        assert full is not None  # to="all": every rank gets it
        new = fn(full, site)
        if isinstance(new, torch.Tensor) and new.shape != full.shape:
            raise ShapeError(
                f"the edit of {site} returned shape {tuple(new.shape)}; the site has shape "
                f"{tuple(full.shape)} (all heads, in global order): return a tensor of the same shape"
            )
        return tp.local(new, kind) if isinstance(new, torch.Tensor) else new

    return edit


# -- kept by name for scripts: the placement answers (adapter.placement.examples(n), .data_rank)
def study_examples(adapter, n: int) -> list[int]:
    """The examples (of ``n``) this rank runs: ``adapter.placement.examples(n)`` (its data rank's share; every rank
    of a tensor-parallel group runs the same ones)."""
    return adapter.placement.examples(n)


def data_rank(adapter) -> int:
    """This rank's index among the ranks that split the examples: ``adapter.placement.data_rank``."""
    return adapter.placement.data_rank


__all__ = [
    "by_heads",
    "data_rank",
    "gate_hook",
    "global_edit",
    "head_out_hook",
    "hooks_for",
    "local_W_O",
    "placement_of",
    "study_examples",
    "world_size",
]
