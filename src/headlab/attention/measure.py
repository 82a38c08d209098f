"""Measured cost: wall time and peak memory of running attention, for the CLI, the benchmarks and
the checks of the cost model against reality. (It runs the engines, so it sits beside them, not in
:mod:`headlab.costs`, which imports none.)

* :func:`time_call` - median seconds of a call, after warm-up.
* :func:`peak_memory_growth` - peak extra resident bytes of a call, measured in a fresh process
  (a process that already ran something keeps freed memory in its allocator, so its resident
  size says little about the next call).
* :func:`bench_attention` - both, for attention backends over sequence lengths, with the ratio
  to torch's ``scaled_dot_product_attention`` timed in the same run, interleaved.

    >>> from headlab.attention.measure import time_call
    >>> time_call(lambda: sum(range(100)), repeats=3, warmup=1) < 1.0
    True
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import headlab.checks as checks
from headlab.costs.model import parse_dtype
from headlab.errors import BackendUnsupportedError, ConfigError, HeadlabError, MemoryBudgetError

__all__ = ["bench_attention", "check_counts", "peak_memory_growth", "rss_bytes", "time_call"]


def time_call(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` runs, after ``warmup`` runs."""
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------
# Peak memory in a fresh process
# ------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """Current resident set size of this process in bytes (Linux ``/proc``; else the peak)."""
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    return _maxrss_bytes()


def _maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024  # bytes on macOS, KiB on Linux


def _reset_peak() -> bool:
    """Reset the kernel's resident high-water mark of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes(reset_ok: bool) -> int:
    if reset_ok:
        kib = _status_kib("VmHWM")
        if kib is not None:
            return kib * 1024
    return _maxrss_bytes()


def run_with_peak(fn: Callable[[], Any]) -> tuple[float, int | None]:
    """Run ``fn()`` once in this process: ``(seconds, peak extra resident bytes)``.

    The peak is the resident high-water mark during the call minus the resident size before it
    (None where the kernel cannot reset the mark). Cheaper than :func:`peak_memory_growth`, but it
    shares the process with everything already allocated.
    """
    reset_ok = _reset_peak()
    base = rss_bytes()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    peak = _peak_bytes(True) - base if reset_ok else None
    del out
    return seconds, peak


def _child(conn, setup, run, args) -> None:
    try:
        torch.set_num_threads(int(os.environ.get("HEADLAB_BENCH_THREADS", torch.get_num_threads())))
        state = setup(*args) if setup is not None else None
        base = rss_bytes()
        reset_ok = _reset_peak()
        result = run(state) if setup is not None else run(*args)
        peak = _peak_bytes(reset_ok)
        conn.send(("ok", max(0, peak - base), result if isinstance(result, (int, float, str, type(None))) else None))
    except HeadlabError as e:
        conn.send(("refused", type(e).__name__, str(e)))
    except BaseException as e:  # noqa: BLE001  (reported to the parent, never swallowed)
        conn.send(("error", type(e).__name__, str(e)))
    finally:
        conn.close()


def _context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "headlab.attention.measure"])
        return ctx
    return multiprocessing.get_context("spawn")


def peak_memory_growth(run: Callable, *args, setup: Callable | None = None, timeout: float = 600.0) -> int:
    """Peak extra resident bytes of ``run`` in a fresh process.

    With ``setup``, the child calls ``state = setup(*args)`` first (allocating inputs), takes its
    resident size as the baseline, then measures ``run(state)``; without, ``run(*args)``.
    Both must be importable module-level functions (they are sent to the child by name).
    Raises the child's :class:`~headlab.errors.HeadlabError` refusal as
    :class:`~headlab.errors.MemoryBudgetError` / :class:`~headlab.errors.BackendUnsupportedError`
    and any other failure as ``RuntimeError``.
    """
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, setup, run, args), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            proc.kill()
            raise RuntimeError(f"memory measurement did not finish within {timeout:.0f} s")
        kind, a, b = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(
            f"memory measurement process died (exit code {proc.exitcode}); "
            "it was probably killed for using too much memory"
        ) from None
    finally:
        proc.join(timeout=10)
    if kind == "ok":
        return int(a)
    if kind == "refused":
        cls = MemoryBudgetError if a == "MemoryBudgetError" else BackendUnsupportedError
        if cls is MemoryBudgetError:
            raise MemoryBudgetError(b, estimate_bytes=0, available_bytes=0, alternative=None)
        raise BackendUnsupportedError(b)
    raise RuntimeError(f"memory measurement failed: {a}: {b}")


# ------------------------------------------------------------------------------------------
# Attention benchmarks
# ------------------------------------------------------------------------------------------


def _inputs(cfg: dict, requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg["seed"])
    dtype = cfg["dtype"]
    B, H, L, D = cfg["batch"], cfg["heads"], cfg["seq_len"], cfg["head_dim"]
    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(dtype).requires_grad_(requires_grad) for _ in range(3))
    return q, k, v


def _call(cfg: dict, backend, q, k, v, grad_out=None):
    from headlab.attention.core import attention

    out = attention(q, k, v, mask=cfg.get("mask"), causal=cfg["causal"], backend=backend)
    if grad_out is not None:
        out.backward(grad_out)
        for t in (q, k, v):
            t.grad = None
    return out


def _mem_setup(cfg: dict, backend):
    if isinstance(cfg.get("mask"), str):
        from headlab.spec.masks import from_string

        cfg = {**cfg, "mask": from_string(cfg["mask"])}
    # one tiny call first: one-time initialisation (kernels, thread pools) is not the call's cost
    warm_mask = cfg.get("mask") if not isinstance(cfg.get("mask"), torch.Tensor) else None  # functions fit any length
    _call(
        {**cfg, "seq_len": 16, "mask": warm_mask},
        backend,
        *_inputs({**cfg, "seq_len": 16}, cfg["backward"]),
        torch.ones(cfg["batch"], cfg["heads"], 16, cfg["head_dim"], dtype=cfg["dtype"]) if cfg["backward"] else None,
    )
    q, k, v = _inputs(cfg, cfg["backward"])
    grad_out = torch.ones_like(q) if cfg["backward"] else None
    return cfg, backend, q, k, v, grad_out


def _mem_run(state) -> None:
    cfg, backend, q, k, v, grad_out = state
    _call(cfg, backend, q, k, v, grad_out)


def _refusal(cfg: dict, backend) -> str | None:
    """Why ``backend`` would refuse the call (memory guard, unsupported feature), or None."""
    from headlab.attention.core import resolve_backend
    from headlab.spec.attention_spec import validate

    meta = torch.empty(0)
    shape = (cfg["batch"], cfg["heads"], cfg["seq_len"], cfg["head_dim"])
    q = meta.new_empty(shape, dtype=cfg["dtype"]).requires_grad_(cfg["backward"])
    try:
        with torch.set_grad_enabled(cfg["backward"]):
            spec, _ = validate(q, q, q, mask=cfg.get("mask"), causal=cfg["causal"])
            resolve_backend(backend, spec).check_memory(spec)
    except (MemoryBudgetError, BackendUnsupportedError) as e:
        return str(e)
    return None


def _backend_name(b) -> str:
    return b if isinstance(b, str) else getattr(b, "name", str(b))


MAX_REPEATS = 10_000  # timed rounds per row: far past what a stable median needs, short of a hang


def check_counts(**counts: int) -> None:
    """Refuse a count below its least value (``warmup`` >= 0, everything else >= 1), by name."""
    for what, val in counts.items():
        checks.int_at_least(what, val, 0 if what == "warmup" else 1)
        if what in ("repeats", "warmup") and val > MAX_REPEATS:  # a timing loop that would run for days
            raise ConfigError(
                f"{what} must be at most {MAX_REPEATS:,} (the median settles after a few rounds), got {val:,}"
            )


def bench_attention(
    seq_lens: Sequence[int],
    backends: Sequence,
    *,
    causal: bool = False,
    backward: bool = False,
    dtype: str | torch.dtype = "float32",
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    pattern=None,
    feature_map: str | None = None,
    repeats: int = 3,
    warmup: int = 1,
    memory: bool = True,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """Time (and measure the peak memory of) attention backends over sequence lengths.

    For each length, the backends and torch's SDPA (the peer, timed even when not listed) run
    interleaved, ``repeats`` rounds after ``warmup``; the median is reported with its ratio to
    SDPA's median. Peak extra memory of one call (forward, or forward + backward) is measured
    in a fresh process per row (``memory=False`` skips it). A backend refused by the memory
    guard or lacking a feature gives a row with ``status="skipped"`` and the reason.

    Args:
        seq_lens: query (= key) lengths.
        backends: backend names or objects.
        pattern: a mask applied to every call: text for :func:`headlab.masks.from_string`
            (``"sliding_window:256"``; preferred: it can be sent to the memory-measuring process)
            or a mask function.
        feature_map: text for :func:`headlab.attention.backends.linear.from_string`; the
            configured linear backend replaces ``"linear"`` in ``backends`` (or is added).
        progress: called with a short description before each measurement (for progress bars).

    Returns:
        One dict per (seq_len, backend): ``seq_len, backend, status, reason, median_s,
        ratio_to_sdpa, sdpa_median_s, peak_extra_bytes, causal, backward, dtype, batch, heads,
        head_dim, pattern``.
    """
    dtype = parse_dtype(dtype)
    check_counts(repeats=repeats, warmup=warmup, batch=batch, heads=heads, head_dim=head_dim)
    if not seq_lens:
        raise ConfigError("seq_lens is empty; give at least one sequence length, e.g. [1024, 2048]")
    if any((not isinstance(n, int)) or n <= 0 for n in seq_lens):
        raise ConfigError(f"sequence lengths must be positive integers, got {list(seq_lens)}")
    pattern_text = None
    if isinstance(pattern, str):  # text travels to the fresh processes that measure memory
        from headlab.spec.masks import from_string

        pattern_text, pattern = pattern, from_string(pattern)
    backends = list(backends)
    if feature_map is not None:
        linear_backend = _linear_from_string(feature_map)
        if "linear" in backends:
            backends[backends.index("linear")] = linear_backend
        else:
            backends.append(linear_backend)
    from headlab.attention import backends as _registry

    for b in backends:
        _registry.get(b)  # UnknownBackendError listing the known names
    rows: list[dict] = []
    cfgs = {
        L: {
            "seq_len": L,
            "batch": batch,
            "heads": heads,
            "head_dim": head_dim,
            "dtype": dtype,
            "causal": causal,
            "backward": backward,
            "mask": pattern,
            "seed": seed,
        }
        for L in seq_lens
    }
    # every refusal (memory guard, missing feature) is known before anything runs
    refusals = {L: {_backend_name(b): _refusal(cfgs[L], b) for b in [*backends, "sdpa"]} for L in seq_lens}
    for L in seq_lens:
        cfg = cfgs[L]
        reasons = refusals[L]
        mine = [b for b in backends if reasons[_backend_name(b)] is None]
        # torch's SDPA is timed beside them for the ratio, unless nothing listed runs at this length
        peers = ["sdpa"] if "sdpa" not in backends and mine else []
        runnable = mine + [b for b in peers if reasons["sdpa"] is None]
        # timing: interleaved rounds over the runnable backends
        q, k, v = _inputs(cfg, backward)
        grad_out = torch.ones_like(q) if backward else None
        times: dict[str, list[float]] = {_backend_name(b): [] for b in runnable}
        errors: dict[str, str] = {}
        for rnd in range(warmup + repeats):
            for b in runnable:
                name = _backend_name(b)
                if name in errors:
                    continue
                if progress is not None:
                    role = " (peer, for the ratio)" if b in peers else ""
                    progress(
                        f"{name}{role} @ {L}: {'warm-up' if rnd < warmup else 'time'} {rnd + 1}/{warmup + repeats}"
                    )
                try:
                    t0 = time.perf_counter()
                    _call(cfg, b, q, k, v, grad_out)
                    dt = time.perf_counter() - t0
                except (MemoryBudgetError, BackendUnsupportedError) as e:
                    errors[name] = str(e)
                    continue
                if rnd >= warmup:
                    times[name].append(dt)
        del q, k, v, grad_out
        sdpa_t = statistics.median(times["sdpa"]) if times.get("sdpa") else None
        for b in backends:
            name = _backend_name(b)
            row = {
                "seq_len": L,
                "backend": name,
                "status": "ok",
                "reason": "",
                "median_s": None,
                "ratio_to_sdpa": None,
                "sdpa_median_s": sdpa_t,
                "peak_extra_bytes": None,
                "causal": causal,
                "backward": backward,
                "dtype": str(dtype).removeprefix("torch."),
                "batch": batch,
                "heads": heads,
                "head_dim": head_dim,
                "pattern": pattern_text or getattr(pattern, "name", None),
            }
            why = reasons.get(name) or errors.get(name)
            if why:
                row.update(status="skipped", reason=why)
                rows.append(row)
                continue
            med = statistics.median(times[name])
            row["median_s"] = med
            row["ratio_to_sdpa"] = med / sdpa_t if sdpa_t else None
            if memory:
                if progress is not None:
                    progress(f"{name} @ {L}: peak memory (fresh process)")
                try:
                    child_cfg = cfg if pattern_text is None else {**cfg, "mask": pattern_text}
                    row["peak_extra_bytes"] = peak_memory_growth(_mem_run, child_cfg, b, setup=_mem_setup)
                except (MemoryBudgetError, BackendUnsupportedError) as e:
                    row.update(status="skipped", reason=str(e))
                except (RuntimeError, AttributeError, TypeError, pickle.PicklingError) as e:
                    # a mask function or backend object that cannot be sent to a fresh process
                    row["reason"] = f"memory not measured ({e}); pass the pattern as text"
            rows.append(row)
    return rows


def _linear_from_string(text: str):
    from headlab.attention.backends.linear import from_string

    return from_string(text)
