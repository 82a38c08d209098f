"""Data-parallel analysis: split a dataset across ``torchrun`` ranks and add up what each rank found.

``torchrun --nproc-per-node N -m headlab heads importance ...`` starts N copies of the command; each
calls :func:`init_from_env`, works on its share of the dataset (every N-th example, starting at its rank:
the model's :class:`~headlab.distributed.placement.Placement` says which, ``placement.examples(n)``), and the
per-example sums are added with :func:`all_reduce_sum`, so the result equals the single-process one up to
float summation order. Only rank 0 shows progress and writes
output (:func:`is_main`). Outside torchrun everything here is the identity: one rank, all the data.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from headlab.distributed.comm import talking, world
from headlab.errors import DistributedError

DEFAULT_TIMEOUT = timedelta(minutes=30)  # a rank that stops answering ends the others after this


def init_from_env(*, timeout: timedelta = DEFAULT_TIMEOUT) -> tuple[int, int]:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

    gloo on CPU, NCCL when CUDA is available. Returns ``(rank, world_size)``; ``(0, 1)`` when not launched
    by torchrun (or with one process), without creating a group. ``WORLD_SIZE`` above 1 without the rest of
    torchrun's environment, or a group that cannot be joined, is a :class:`~headlab.errors.DistributedError`
    saying to start the command under torchrun.
    """
    if dist.is_available() and dist.is_initialized():
        return world()
    size = os.environ.get("WORLD_SIZE", "1").strip() or "1"
    under = (
        "start the command under torchrun (torchrun --nproc-per-node N -m headlab ...), or unset WORLD_SIZE "
        "to run in one process"
    )
    if not size.isdigit():
        raise DistributedError(f"WORLD_SIZE={size!r} is not a number of processes; {under}")
    if int(size) <= 1:
        return 0, 1
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v, "").strip()]
    if missing or not dist.is_available():
        why = (
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
            if missing
            else "this torch has no torch.distributed"
        )
        raise DistributedError(f"WORLD_SIZE={size} says this is one of {size} processes, but {why}; {under}")
    rank = os.environ["RANK"].strip()
    if not rank.isdigit() or int(rank) >= int(size):
        raise DistributedError(f"RANK={rank!r} is not a rank of WORLD_SIZE={size} (0..{int(size) - 1}); {under}")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        dist.init_process_group(backend, timeout=timeout)
    except (ValueError, RuntimeError) as e:  # a bad RANK, an address that cannot be reached or bound
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DistributedError(
            f"could not join the process group of {size} processes (RANK="
            f"{os.environ['RANK']}, MASTER_ADDR={os.environ['MASTER_ADDR']}, MASTER_PORT="
            f"{os.environ['MASTER_PORT']}): {first}; {under}"
        ) from e
    atexit.register(_leave)
    return world()


def _leave() -> None:
    """At exit, leave the group this module joined: its threads are joined before the interpreter tears down
    (left to the destructors, a gloo rank can abort with "terminate called without an active exception" and fail
    the whole torchrun after its work is done)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):  # pragma: no cover - already torn down by torch
            pass


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of ``t`` over every rank (a new tensor; ``t`` itself when there is one rank)."""
    rank, size = world(group)
    if size == 1:
        return t
    out = t.detach().clone()
    with talking("summing results across ranks", rank):
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def is_main(group=None) -> bool:
    """True on rank 0 (and outside torchrun): the rank that shows progress and writes output."""
    return world(group)[0] == 0


def all_reduce_many(parts: list, group=None) -> list[torch.Tensor]:
    """:func:`all_reduce_sum` of several arrays or tensors at once (one message): float64 sums, in order,
    each of its input's shape."""
    ts = [torch.as_tensor(p, dtype=torch.float64) for p in parts]
    flat = all_reduce_sum(torch.cat([t.reshape(-1) for t in ts]) if ts else torch.zeros(0, dtype=torch.float64), group)
    out, at = [], 0
    for t in ts:
        out.append(flat[at : at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def gather_objects(obj, group=None) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` with one rank."""
    rank, size = world(group)
    if size == 1:
        return [obj]
    got = [None] * size
    with talking("gathering results from every rank", rank):
        dist.all_gather_object(got, obj, group=group)
    return got


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank when ``flag`` is true on any (so that every rank takes the same branch)."""
    return bool(all_reduce_sum(torch.tensor([float(bool(flag))], dtype=torch.float64), group)[0] > 0)
