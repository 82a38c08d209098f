"""Which rank holds which heads and runs which units: one :class:`Placement` per model, and the sums over a group.

A run is laid out as a ``(data, tensor)`` mesh, the tensor axis last (as torch's ``init_device_mesh`` lays it):
``world`` ranks in groups of ``tensor_size`` consecutive ranks; each group holds one copy of the model, cut by
heads across its ranks when the model is sharded by tensor parallelism, and the groups (the data ranks) split
the work. Four kinds, one arithmetic:

    ==================  =====  ===========  ==========================================================
    kind                world  tensor_size  what each rank does
    ==================  =====  ===========  ==========================================================
    one process         1      1            every head, every unit
    data parallel       W      1            every head, every W-th unit
    tensor parallel     W      W            H/W heads, every unit (its forwards are collectives)
    (data, tensor)      W      T            H/T heads, every (W/T)-th unit, alike in its group of T
    ==================  =====  ===========  ==========================================================

    >>> p = Placement(world=4, rank=3, tensor_size=2, n_heads=8, n_kv_heads=4, sharded=True)
    >>> p.kind, p.tensor_rank, p.data_rank, p.data_size, list(p.heads()), list(p.kv_heads())
    ('mesh', 1, 1, 2, [4, 5, 6, 7], [2, 3])
    >>> p.units(["a", "b", "c", "d", "e"]), p.owner(5)
    (['b', 'd'], (1, 1))

A study that adds over examples makes each head's sum on the rank that holds it (zero elsewhere) over its data
rank's examples, so one sum over the ranks (:meth:`Placement.sum_heads`) adds both the heads of a group and the
examples of the groups; a figure every rank of a group holds alike (a token count, sums of gathered captures) is
added over the data ranks only (:meth:`Placement.sum_over_data`).

:class:`TensorParallel` is the one form of a request for tensor parallelism (``headlab.load(...,
tensor_parallel=True | N)``, ``--tensor-parallel [--tensor-size N]``), checked once where it enters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist

from headlab.checks import positive_int
from headlab.distributed.comm import talking
from headlab.distributed.comm import world as _world
from headlab.errors import ConfigError, InputError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

Q_KINDS = ("q", "pattern", "z", "head_out")  # sites whose axis 1 is the query heads
KV_KINDS = ("k", "v")  # sites whose axis 1 is the kv heads
STATS_FIELDS = (
    "lse",
    "entropy",
    "max_weight",
    "argmax",
    "mean_distance",
    "key_mass",
    "received",
    "rows",
    "output",
    "visible",
)  # AttentionStats fields with a head axis (axis 1)


def is_dtensor(t) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (read by name: nothing is imported)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "placements")


@dataclass(frozen=True)
class TensorParallel:
    """A request to shard the model by heads: over every rank (``size`` None) or groups of ``size`` ranks.

    >>> TensorParallel.request(True), TensorParallel.request(2), TensorParallel.request(False)
    (TensorParallel(size=None), TensorParallel(size=2), None)
    >>> TensorParallel.request(2).group_size(4), TensorParallel.request(True).group_size(4)
    (2, 4)
    """

    size: int | None = None

    @classmethod
    def request(cls, value) -> TensorParallel | None:
        """The request in its one form: None for ``False`` or None (no tensor parallelism), every rank for
        ``True``, groups of N for a positive integer N; anything else is a :class:`ConfigError`."""
        if isinstance(value, TensorParallel):
            return value
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        return cls(
            positive_int(
                "tensor_parallel",
                value,
                message=(
                    "tensor_parallel={value!r}: give True (every rank in one tensor-parallel group) or the ranks per group, "
                    "a positive integer dividing the world size"
                ),
            )
        )

    @classmethod
    def from_flags(cls, on: bool, size: int | None) -> TensorParallel | None:
        """The request of the command line's ``--tensor-parallel`` and ``--tensor-size`` (InputError in their words)."""
        if size is not None and not on:
            raise InputError("--tensor-size acts only with --tensor-parallel; add --tensor-parallel or drop it")
        if size is not None and size < 1:  # 0 would read as "no tensor parallelism" further down
            raise InputError(f"--tensor-size must be at least 1 (ranks per tensor-parallel group), got {size}")
        return (cls(size) if size is not None else cls()) if on else None

    def group_size(self, world: int, *, flag: bool = False) -> int:
        """Ranks per tensor-parallel group over ``world`` ranks: every rank, or ``size``, which must divide it
        (a :class:`ConfigError`, or with ``flag`` an InputError in the command line's words)."""
        if self.size is None:
            return world
        if world % self.size:
            if flag:
                raise InputError(
                    f"--tensor-size {self.size} does not divide the {world} ranks torchrun started; "
                    f"give a divisor of {world}"
                )
            raise ConfigError(
                f"tensor_parallel={self.size} over {world} ranks: the ranks per tensor-parallel group "
                f"must divide the world size; use a divisor of {world}"
            )
        return self.size


@dataclass(frozen=True)
class Placement:
    """Where this rank sits: ``world`` ranks, ``rank`` this one's; groups of ``tensor_size`` consecutive ranks, each
    holding the model (cut by heads across the group when ``sharded``); the groups split the units.
    ``n_heads``/``n_kv_heads``: the whole model's heads per layer; ``group``: the tensor-parallel process group."""

    world: int = 1
    rank: int = 0
    tensor_size: int = 1
    n_heads: int = 0
    n_kv_heads: int = 0
    sharded: bool = False
    group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ConfigError(
                f"a placement of rank {self.rank} in a world of {self.world}: give a world of at least "
                "1 and a rank in [0, world)"
            )
        if self.tensor_size < 1 or self.world % self.tensor_size:
            raise ConfigError(
                f"a tensor-parallel group of {self.tensor_size} ranks in a world of {self.world}: the "
                "group's size must divide the world size"
            )
        if self.n_heads % self.tensor_size or self.n_kv_heads % self.tensor_size:
            raise ConfigError(
                f"{self.n_heads} query and {self.n_kv_heads} kv heads over {self.tensor_size} ranks: "
                "every rank of a group must hold as many heads as the others"
            )

    @classmethod
    def here(cls, n_heads: int = 0, n_kv_heads: int = 0) -> Placement:
        """This process's placement when the model is not sharded: every rank a data rank (under torchrun, from
        the default process group), one process otherwise."""
        rank, world = _world()
        return cls(world=world, rank=rank, n_heads=n_heads, n_kv_heads=n_kv_heads)

    @classmethod
    def of(cls, loaded) -> Placement:
        """The placement of a loaded model (or adapter), or this process's own (:meth:`here`) for None (no model)."""
        place = getattr(getattr(loaded, "adapter", loaded), "placement", None)
        return place if isinstance(place, Placement) else cls.here()

    # -- the mesh ------------------------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """``"single"``, ``"data"`` (data parallel), ``"tensor"`` (tensor parallel) or ``"mesh"`` (both)."""
        if self.tensor_size == 1:
            return "single" if self.world == 1 else "data"
        return "tensor" if self.tensor_size == self.world else "mesh"

    @property
    def alone(self) -> bool:
        """One process: every answer is the trivial one."""
        return self.world == 1

    @property
    def tensor_rank(self) -> int:
        """This rank's index in its tensor-parallel group."""
        return self.rank % self.tensor_size

    @property
    def data_rank(self) -> int:
        """This rank's index among the ranks that split the units (its tensor-parallel group's index)."""
        return self.rank // self.tensor_size

    @property
    def data_size(self) -> int:
        """How many ranks (tensor-parallel groups) split the units."""
        return self.world // self.tensor_size

    def unit_share(self) -> tuple[int, int]:
        """``(share, shares)``: this rank runs every ``shares``-th unit from ``share`` (alike in its group)."""
        return self.data_rank, self.data_size

    def units(self, todo) -> list:
        """This rank's share of the work list ``todo``: every data-size-th item from its data rank."""
        return list(todo)[self.data_rank :: self.data_size]

    def examples(self, n: int) -> list[int]:
        """The indices (of ``n`` examples) this rank runs: :meth:`units` of ``range(n)``."""
        return self.units(range(n))

    def group_view(self) -> Placement:
        """The tensor-parallel group alone (``rank``, ``world`` within it): what ``adapter.tp`` shows."""
        return dataclasses.replace(self, world=self.tensor_size, rank=self.tensor_rank)

    # -- heads ---------------------------------------------------------------------------------------------------
    @property
    def local_heads(self) -> int:
        """Query heads each rank holds: ``H // tensor_size``."""
        return self.n_heads // self.tensor_size

    @property
    def local_kv_heads(self) -> int:
        return self.n_kv_heads // self.tensor_size

    def heads(self, tensor_rank: int | None = None) -> range:
        """Global indices of the query heads ``tensor_rank`` (default: this rank's) holds, in its local order."""
        r = self.tensor_rank if tensor_rank is None else tensor_rank
        return range(r * self.local_heads, (r + 1) * self.local_heads)

    def kv_heads(self, tensor_rank: int | None = None) -> range:
        r = self.tensor_rank if tensor_rank is None else tensor_rank
        return range(r * self.local_kv_heads, (r + 1) * self.local_kv_heads)

    def global_index(self, local: int, tensor_rank: int | None = None) -> int:
        """The global index of local query head ``local`` of ``tensor_rank``."""
        return self.heads(tensor_rank)[local]

    def owner(self, head: int) -> tuple[int, int]:
        """``(tensor rank, local index)`` of global query head ``head``."""
        return divmod(int(head), self.local_heads)

    def heads_of(self, kind: str) -> range:
        """Global indices of what axis 1 of this rank's ``kind`` holds: query heads, or kv heads for k and v."""
        return self.kv_heads() if kind in KV_KINDS else self.heads()

    # -- tensors -------------------------------------------------------------------------------------------------
    is_dtensor = staticmethod(is_dtensor)

    @staticmethod
    def full(t):
        """A weight (or a view of one) whole on every rank: a DTensor's ``full_tensor()`` (a collective: every rank
        calls it alike), a plain tensor itself."""
        return t.full_tensor() if is_dtensor(t) else t

    @staticmethod
    def to_local(t):
        """This rank's shard of a DTensor; a plain tensor (or None) itself."""
        return t.to_local() if is_dtensor(t) else t

    def local(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        """This rank's slice (axis 1) of a site's tensor in global head order."""
        if not self.sharded or kind not in Q_KINDS + KV_KINDS:
            return t
        r = self.heads_of(kind)
        return t[:, r.start : r.stop]

    def gather(self, t: torch.Tensor, kind: str, to: str = "all") -> torch.Tensor | None:
        """``t`` (this rank's heads on axis 1) from every rank of the group, concatenated in global head order: on
        every rank (``to="all"``, an all-gather), or on the group's rank 0 alone (``to="rank0"``, a gather; the
        others get None). Sites without a head axis, and a model that is not sharded, come back as they are."""
        if kind not in Q_KINDS + KV_KINDS or not self.sharded or self.tensor_size == 1:
            return t
        if t.dtype == torch.bool:  # not every backend gathers booleans (the stats' ``visible``)
            got = self.gather(t.to(torch.uint8), kind, to)
            return None if got is None else got.bool()
        t, me = t.detach().contiguous(), self.tensor_rank
        if to == "rank0":
            parts = [torch.empty_like(t) for _ in range(self.tensor_size)] if me == 0 else None
            with talking(f"the tensor-parallel gather of {kind!r} to rank 0", me):
                dist.gather(t, parts, group=self.group, group_dst=0)
            return None if parts is None else torch.cat(parts, dim=1)
        parts = [torch.empty_like(t) for _ in range(self.tensor_size)]
        with talking(f"the tensor-parallel all-gather of {kind!r}", me):
            dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=1)

    def gather_sites(self, data: dict[str, object], to: str = "all") -> dict[str, object]:
        """A capture's ``{site: tensor}`` (this rank's heads) in global head order: on every rank (``to="all"``),
        or on rank 0 (``to="rank0"``: every other rank of the group gets ``{}``). Every rank holds the same sites
        (they ran the same capture), so the gathers pair up; statistics (computed on each rank for its heads) are
        gathered field by field."""
        out: dict[str, object] = {}
        for name in sorted(data):  # the same order on every rank
            value, kind = data[name], name.rsplit(".", 1)[-1]
            if isinstance(value, torch.Tensor):
                out[name] = self.gather(value, kind, to)
            elif kind == "stats" and dataclasses.is_dataclass(value) and not isinstance(value, type):
                got = {
                    f: self.gather(getattr(value, f), "q", to)
                    for f in STATS_FIELDS
                    if isinstance(getattr(value, f, None), torch.Tensor)
                }
                out[name] = dataclasses.replace(value, **got)
            else:
                out[name] = value
        if to == "rank0" and self.sharded and self.tensor_rank != 0:
            return {}
        return {name: out[name] for name in data}  # the capture's own order

    # -- sums over the ranks -------------------------------------------------------------------------------------
    def sum_heads(self, t: torch.Tensor) -> torch.Tensor:
        """Per-head sums ``(..., n_heads)``, made on each head's owner (zero elsewhere) over this data rank's
        examples, added over every rank: the group's heads and the data ranks' examples at once."""
        from headlab.distributed.data import all_reduce_sum

        if not self.sharded:
            return all_reduce_sum(t)
        return all_reduce_sum(t, self.group if self.data_size == 1 else None)

    def sum_group(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` added over the tensor-parallel group alone (each rank's part of a sum over heads); ``t`` itself
        when the model is not sharded."""
        from headlab.distributed.data import all_reduce_sum

        return all_reduce_sum(t, self.group) if self.sharded else t

    def sum_over_data(self, x):
        """Sums every rank of a group holds alike (a token count; a study of gathered captures), added over the
        data ranks: each group's copy once. A tensor gives a tensor; a list of arrays or tensors gives float64
        tensors, in order (one message)."""
        from headlab.distributed.data import all_reduce_many, all_reduce_sum

        many = isinstance(x, (list, tuple))
        if self.data_size == 1:
            return [torch.as_tensor(p, dtype=torch.float64) for p in x] if many else x
        summed = all_reduce_many(list(x)) if many else all_reduce_sum(x)
        if self.tensor_size == 1:
            return summed
        return [t / self.tensor_size for t in summed] if many else summed / self.tensor_size


__all__ = ["KV_KINDS", "Placement", "Q_KINDS", "STATS_FIELDS", "TensorParallel", "is_dtensor"]
