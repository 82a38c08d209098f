"""Data x tensor parallelism: a 2-D mesh of ``data`` groups, each a tensor-parallel group holding the whole model.

``torchrun --nproc_per_node 4`` with ``headlab.load(path, tensor_parallel=2)`` lays the 4 ranks out as a
``(data=2, tensor=2)`` mesh, as torch's ``init_device_mesh`` does (the tensor axis last, so ranks ``{0, 1}`` and
``{2, 3}`` each hold one copy of the model, cut in two by heads):

                     tensor rank 0       tensor rank 1
    data rank 0:     rank 0 (heads 0..H/2)   rank 1 (heads H/2..H)
    data rank 1:     rank 2 (heads 0..H/2)   rank 3 (heads H/2..H)

Which rank runs which examples and holds which heads, and the sums over the ranks, are the model's
:class:`~headlab.distributed.placement.Placement` (``adapter.placement``): a study that adds over examples (head
importance) splits them across the data ranks (every ``D``-th); inside a tensor-parallel group every rank runs the
same examples (its forwards are collectives); each head's sum is made on the rank that holds it, zero elsewhere, so
one sum over all ranks adds both the heads of a group and the examples of the groups. With ``tensor_parallel=True``
(or the whole world) there is one data rank and this is plain tensor parallelism.

transformers builds its own meshes for tensor parallelism alone (``DistributedConfig(tp_size=world)``) or with
FSDP for the data axis, which would shard the weights a second time; for a replicated data axis
:func:`load_sharded` builds the mesh itself and shards the model with transformers' own plan and
``apply_tensor_parallelism`` on the tensor axis. Each rank then reads the whole checkpoint before keeping its
slices (transformers' own loading reads only its slices), so a 2-D load needs the whole model's memory for a
moment: :func:`headlab.load` checks the memory cap against that.

The second half serves physical pruning of a sharded model (:mod:`headlab.models.surgery`): a deep copy that
shares the process groups and copies each DTensor as this rank's shard (:func:`sharded_memo`), the DTensors of a
layer unwrapped to plain local tensors for the family's cut and wrapped again (:func:`unwrap`, :func:`rewrap`),
and transformers' sharded forwards installed again on the copy (:func:`reinstall_forwards`).

Nothing here imports :mod:`headlab.models.tensor_parallel`.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from headlab.distributed.placement import is_dtensor
from headlab.errors import ConfigError, UnsupportedArchitectureError

__all__ = ["check_before_load", "load_sharded", "reinstall_forwards", "rewrap", "sharded_memo", "unwrap"]


def check_before_load(config, world: int) -> bool:
    """Refuse, from the config alone, a model that cannot be sharded by heads over ``world`` ranks. Returns True
    for a type no family declares: it is read by structure on the whole model and cut after
    (:mod:`headlab.models.tp_structure`, which checks the heads found), so it needs no plan in transformers."""
    mt = getattr(config, "model_type", "?")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    from headlab.models.hf.registry import adapter_class  # the families headlab declares (the loader imported them)

    by_structure = adapter_class(mt) is None
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not plan and not by_structure:
        raise UnsupportedArchitectureError(
            f"model type {mt!r} has no tensor-parallel plan in transformers (its config's base_model_tp_plan is "
            "empty), so it cannot be sharded by heads; load it without tensor_parallel"
        )
    H = getattr(text, "num_attention_heads", None)
    Hkv = getattr(text, "num_key_value_heads", None) or H
    if by_structure:  # checked here when the config says the heads, and again on the heads found
        from headlab.models.tp_structure import check_heads

        if isinstance(H, int) and isinstance(Hkv, int):
            check_heads(mt, H, Hkv, world)
        return True
    if H is None:
        raise UnsupportedArchitectureError(f"cannot read the query heads of a {mt!r} config")
    if H % world:
        raise ConfigError(
            f"tensor parallelism over {world} ranks: the model has {H} query heads, which {world} does "
            f"not divide; use a world size that divides {H}"
        )
    assert Hkv is not None  # or H, read above
    if Hkv % world:
        raise ConfigError(
            f"tensor parallelism over {world} ranks: the model has {Hkv} key/value heads, which {world} does not "
            "divide; transformers' plan cuts k_proj and v_proj into equal row blocks, so a kv head would be split "
            f"across ranks (it does not replicate kv heads); use at most {Hkv} ranks, a divisor of {Hkv}"
        )
    return by_structure


def load_sharded(cls, path, *, tp_size: int, dtype: torch.dtype):
    """``cls.from_pretrained(path)`` sharded by transformers' plan over groups of ``tp_size`` consecutive ranks of a
    ``(world / tp_size, tp_size)`` mesh (the data axis replicated). Starts the process group if torchrun's
    environment says so and none is running."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from headlab.distributed.data import init_from_env

    _, world = init_from_env()  # tp_size divides world: headlab.load checked it (TensorParallel.group_size)
    cuda = torch.cuda.is_available()
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world // tp_size, tp_size), mesh_dim_names=("data", "tp"))
    model = cls.from_pretrained(path, local_files_only=True, attn_implementation="eager", dtype=dtype)
    if cuda:
        model = model.to(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        raise UnsupportedArchitectureError(f"{type(model).__name__} has no tensor-parallel plan in transformers")
    apply_tensor_parallelism(model, mesh["tp"], model._expand_parallel_plan(plan))
    return model


# -- copying and cutting a sharded model (headlab.models.surgery) ----------------------------------------------
def sharded_memo(model: nn.Module) -> dict:
    """What a deep copy of a sharded model must not copy itself: its DTensor parameters (copied here, this rank's
    shard with the same mesh and placements) and the process groups and meshes its modules and config refer to
    (shared: they cannot be copied, and the copy runs on the same ones)."""
    from torch.distributed.tensor import DTensor

    def distributed(v) -> bool:
        return type(v).__module__.startswith(("torch.distributed", "torch._C._distributed", "transformers.distributed"))

    memo: dict = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and is_dtensor(p) and id(p) not in memo:
                local = p.to_local().detach().clone()
                memo[id(p)] = nn.Parameter(
                    DTensor.from_local(
                        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                    ),
                    requires_grad=p.requires_grad,
                )
        for k, v in [*vars(m).items(), *vars(getattr(m, "config", None) or m).items()]:
            if distributed(v) or k in ("_headlab", "_headlab_adapter"):  # headlab's own: dropped from the copy
                memo[id(v)] = v
    return memo


def unwrap(*modules: nn.Module) -> list:
    """Replace every DTensor parameter under ``modules`` by a plain tensor of this rank's shard; returns what
    :func:`rewrap` needs to wrap them again."""
    out = []
    for m in {id(m): m for top in modules for m in top.modules()}.values():
        for name, p in list(m._parameters.items()):
            if p is not None and is_dtensor(p):
                out.append((m, name, p.device_mesh, p.placements, p.requires_grad))
                m._parameters[name] = nn.Parameter(p.to_local().detach().clone(), requires_grad=p.requires_grad)
    return out


def rewrap(wrapped: list) -> None:
    """Wrap the (cut) local tensors again as DTensors on their mesh and placements; a Linear's feature counts
    become the global ones again (transformers' forwards read them)."""
    from torch.distributed.tensor import DTensor

    for m, name, mesh, placements, grad in wrapped:
        local = m._parameters[name].detach()
        m._parameters[name] = nn.Parameter(
            DTensor.from_local(local, mesh, placements, run_check=False), requires_grad=grad
        )
        if name == "weight" and isinstance(m, nn.Linear):
            m.out_features, m.in_features = m.weight.shape


def reinstall_forwards(model: nn.Module) -> None:
    """transformers installs each sharded module's forward as a closure over the module and its mesh; in a deep
    copy that closure still runs the original module, so install it again on the copy's module."""
    for m in model.modules():
        fn = m.__dict__.get("forward")
        code = getattr(fn, "__code__", None)
        if code is None or not {"self", "mesh", "module"} <= set(code.co_freevars):
            continue
        assert fn is not None  # it has a __code__
        cells = dict(zip(code.co_freevars, fn.__closure__))
        style, mesh = cells["self"].cell_contents, cells["mesh"].cell_contents
        del m.forward
        style.install_forward(m, mesh)
