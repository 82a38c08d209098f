"""What the ranks say to each other: the agreement check before any work, and ring shifts.

Every collective here runs on a ``torch.distributed`` process group (gloo on CPU, NCCL on GPUs). A
rank that dies or stops answering makes the others fail after the process group's timeout (the
``timeout=`` given to ``init_process_group``; torch's default is 30 minutes for gloo, 10 for NCCL)
with a :class:`~headlab.errors.DistributedError` that names this rank and the peer, never a hang.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from headlab.errors import DistributedError

_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
_SENT = [0]  # bytes this process has sent in ring shifts (what the cost model predicts)


def bytes_sent() -> int:
    """Bytes this process has sent round the ring so far (all calls); compare with :func:`headlab.costs.ring.ring_cost`."""
    return _SENT[0]


def world(group=None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` (the default group when None); ``(0, 1)`` when not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@contextlib.contextmanager
def talking(what: str, rank: int, peer: int | None = None):
    """Turn a failed or timed-out collective into a DistributedError saying who waited for whom."""
    try:
        yield
    except DistributedError:
        raise
    except RuntimeError as e:  # gloo / NCCL raise RuntimeError (or a subclass) on timeouts and lost peers
        who = f" with rank {peer}" if peer is not None else ""
        raise DistributedError(
            f"rank {rank}: {what}{who} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}. A rank that "
            "died or stopped answering ends the others after the process group's timeout "
            "(init_process_group(timeout=...))"
        ) from e


def agree(rank: int, world_size: int, group, *, device=None, **facts: int | str | torch.dtype) -> None:
    """Check that every rank passes the same facts (dtype, head counts, shard lengths...), with one small
    all-gather; a mismatch raises the same DistributedError on every rank, naming what differs."""
    names = list(facts)
    codes = []
    for value in facts.values():
        if isinstance(value, torch.dtype):
            codes.append(_DTYPES.index(value) if value in _DTYPES else -1)
        elif isinstance(value, str):
            codes.append(sum(ord(c) * 31**i for i, c in enumerate(value)) % (2**31))
        else:
            codes.append(int(value))
    mine = torch.tensor(codes, dtype=torch.int64, device=device)  # on the tensors' device (NCCL needs the GPU)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    with talking("the agreement all-gather", rank):
        dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()  # (world, facts)
    differ = [i for i in range(len(names)) if bool((table[:, i] != table[0, i]).any())]
    if differ:

        def show(i, r):
            code = int(table[r, i])
            if isinstance(facts[names[i]], torch.dtype):
                return str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else "?"
            return str(code) if not isinstance(facts[names[i]], str) else f"code {code}"

        parts = [f"{names[i]}: " + ", ".join(f"rank {r} has {show(i, r)}" for r in range(world_size)) for i in differ]
        raise DistributedError(
            "the ranks disagree before ring attention (every rank must pass shards of the same "
            "length, dtype and head counts, and the same options): " + "; ".join(parts)
        )


class Ring:
    """Shifts around the ring: send to ``rank + 1``, receive from ``rank - 1``, asynchronously."""

    def __init__(self, rank: int, world_size: int, group) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.next = (rank + 1) % world_size
        self.prev = (rank - 1) % world_size
        self.sent_bytes = 0

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def start(self, send: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, list]:
        """Begin sending ``send`` forward and receiving a tensor of its shape from behind; returns
        ``(buffer, requests)``; call :meth:`finish` before reading the buffer. Streams that are in
        flight at once (K/V and the dK/dV accumulators) use different tags."""
        recv = torch.empty_like(send)
        with talking("a ring shift", self.rank, self.next):
            reqs = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, send.contiguous(), self._global(self.next), self.group, tag),
                    dist.P2POp(dist.irecv, recv, self._global(self.prev), self.group, tag),
                ]
            )
        self.sent_bytes += send.numel() * send.element_size()
        _SENT[0] += send.numel() * send.element_size()
        return recv, reqs

    def start_pair(self, a: torch.Tensor, b: torch.Tensor, tag: int = 0):
        """:meth:`start` for two tensors (K and V, or their gradients), tags ``tag`` and ``tag + 1``."""
        return self.start(a, tag), self.start(b, tag + 1)

    def finish_pair(self, pending) -> tuple[torch.Tensor, torch.Tensor]:
        (a, ra), (b, rb) = pending
        self.finish(ra)
        self.finish(rb)
        return a, b

    def finish(self, reqs: list) -> None:
        with talking("a ring shift", self.rank, self.prev):
            for r in reqs:
                r.wait()
