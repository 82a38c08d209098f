"""Running a kernel's independent work units on the CPU cores.

torch releases the GIL inside its ops, so a pool of ``torch.get_num_threads()`` Python threads,
each running single-threaded torch ops on its own units, uses every core with one parallel region
per call instead of one OpenMP region (and barrier) per medium-sized op; each thread also keeps its
small tile in its own core's cache. The tiled and sparse backends' forwards use it.

Side effect, documented where it is used: while the pool runs, torch's intra-op thread count is 1
(process-wide); it is restored afterwards, also on error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch


# Tests switch it off (monkeypatch) to compare the threaded forwards with the serial ones.
THREADED = True


def run_units(fn: Callable, units: Sequence) -> None:
    """Call ``fn(unit)`` for every unit, in a thread pool when that can help.

    The units run serially in the calling thread when there is one torch thread or one unit,
    when :data:`THREADED` is False, or under a dispatch mode (``FlopCounterMode``, profilers), which
    only sees its own thread. Grad mode and inference mode are thread-local: the workers run
    under ``no_grad`` and carry the caller's inference mode over.
    """
    n = torch.get_num_threads()
    if n <= 1 or len(units) <= 1 or not THREADED or torch._C._len_torch_dispatch_stack() > 0:
        for u in units:
            fn(u)
        return
    inference = torch.is_inference_mode_enabled()

    def worker(u) -> None:
        torch.set_num_threads(1)  # this thread's ops run single-threaded
        with torch.inference_mode(inference), torch.no_grad():  # the forward records nothing
            fn(u)

    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=min(n, len(units))) as pool:
            for f in [pool.submit(worker, u) for u in units]:
                f.result()
    finally:
        torch.set_num_threads(n)
