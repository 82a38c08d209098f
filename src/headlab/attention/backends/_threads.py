"""Running a kernel's independent work units on the CPU cores.

torch releases the GIL inside its ops, so a pool of ``torch.get_num_threads()`` Python threads,
each running single-threaded torch ops on its own units, uses every core with one parallel region
per call instead of one OpenMP region (and barrier) per medium-sized op; each thread also keeps its
small tile in its own core's cache. The tiled and sparse backends' forwards use it.

Side effect, documented where it is used: while the pool runs, torch's intra-op thread count is 1
(process-wide); it is restored afterwards, also on error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

# Tests switch it off (monkeypatch) to compare the threaded forwards with the serial ones.
THREADED = True

# One pool for the process, kept between calls: starting threads cost about 2 ms per call, the
# fixed cost that dominated short sequences (a 1,024-token tiled forward takes about 10 ms).
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def _single_threaded() -> None:
    torch.set_num_threads(1)  # each worker's ops run single-threaded


def _pool(n: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE != n:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="headlab", initializer=_single_threaded)
            _POOL_SIZE = n
        return _POOL


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
        with torch.inference_mode(inference), torch.no_grad():  # the forward records nothing
            fn(u)

    pool = _pool(n)
    torch.set_num_threads(1)
    try:
        futures = [pool.submit(worker, u) for u in units]
        wait(futures)  # all of them, also when one fails: none may outlive the call
        for f in futures:
            f.result()
    finally:
        torch.set_num_threads(n)
