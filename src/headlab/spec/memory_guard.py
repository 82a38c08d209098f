"""Memory guard: refuse a request that will not fit, before anything is allocated."""

from __future__ import annotations

import os

import torch

from headlab.environment import memory_limit_override  # the variable is read in the base layer
from headlab.errors import MemoryBudgetError
from headlab.units import human_bytes

__all__ = ["HEADROOM", "available_memory", "check_fits", "human_bytes", "memory_limit_override"]

# Keep this share of available memory free for everything else in the process.
HEADROOM = 0.9


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(path).read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:
            usage = None
            for upath in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
                try:
                    usage = int(open(upath).read().strip())
                    break
                except (OSError, ValueError):
                    continue
            return int(raw) - (usage or 0)
    return None


def available_memory(device: torch.device | str = "cpu") -> int:
    """Bytes that can still be allocated on ``device`` (host RAM for the CPU).

    The environment variable ``HEADLAB_MEMORY_LIMIT`` (bytes, or a size such as ``10GiB``, ``512M``,
    ``1.5G``: see :func:`memory_limit_override`) overrides the reading, for tests and for users who
    want to leave room for other work.
    """
    override = memory_limit_override()
    if override is not None:
        return override
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_limit()
    return min(avail, limit) if limit is not None else avail


def check_fits(estimate_bytes: int, *, what: str, device: torch.device | str = "cpu", alternative: str | None) -> None:
    """Raise :class:`MemoryBudgetError` when ``estimate_bytes`` exceeds what is available."""
    available = available_memory(device)
    if estimate_bytes > HEADROOM * available:
        hint = f"; use backend={alternative!r}, which does not materialise the n x n map" if alternative else ""
        raise MemoryBudgetError(
            f"{what} needs about {human_bytes(estimate_bytes)} but only {human_bytes(available)} is available "
            f"on {torch.device(device)}{hint}",
            estimate_bytes=estimate_bytes,
            available_bytes=available,
            alternative=alternative,
        )
