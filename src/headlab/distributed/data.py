"""Data-parallel analysis: split a dataset across ``torchrun`` ranks and add up what each rank found.

``torchrun --nproc-per-node N -m headlab heads importance ...`` starts N copies of the command; each
calls :func:`init_from_env`, works on its share of the dataset (every N-th example, starting at its rank:
the model's :class:`~headlab.distributed.placement.Placement` says which, ``placement.examples(n)``), and the
per-example sums are added with :func:`all_reduce_sum`, so the result equals the single-process one up to
float summation order. Only rank 0 shows progress and writes
output (:func:`is_main`). Outside torchrun everything here is the identity: one rank, all the data.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from headlab.distributed.comm import talking, world

DEFAULT_TIMEOUT = timedelta(minutes=30)  # a rank that stops answering ends the others after this


def init_from_env(*, timeout: timedelta = DEFAULT_TIMEOUT) -> tuple[int, int]:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

    gloo on CPU, NCCL when CUDA is available. Returns ``(rank, world_size)``; ``(0, 1)`` when not launched
    by torchrun (or with one process), without creating a group.
    """
    if dist.is_available() and dist.is_initialized():
        return world()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timeout)
    return world()


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
        out.append(flat[at:at + t.numel()].view(t.shape))
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
