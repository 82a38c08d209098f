"""The native engine: the compiled one-pass attention kernel (``csrc/onepass.cpp``), built at
install time, and everything headlab knows about it. See docs/native.md.

This module is the kernel's only caller: it owns the C++ calling convention (flat float32
buffers, the key bias, the window's ``(before, after)``, the work-unit sizes), the forms of its
per-row statistics, and the one decision whether the kernel takes a call. Its users (the
statistics, the tiled and sparse backends, the ring) ask :func:`declines` and keep their own
PyTorch paths for the calls it declines::

    why = native.declines(spec, mask, compute_dtype)     # None: the kernel takes it
    fwd = native.forward(q, k, v, mask, scale, causal=spec.causal)
    fwd.out, fwd.lse                                     # (B, H, Lq, Dv), (B, H, Lq)
    dq, dk, dv = native.backward(q, k, v, dout, fwd.m, fwd.log_l, mask, scale, causal=spec.causal, out=fwd.out)
    native.statistics(q, k, v, mask, scale, {"entropy", "received"}, causal=False)   # attention_stats

The C++ file is compiled when headlab is installed (``setup.py``: torch's
``torch.utils.cpp_extension.CppExtension``, about a minute on 2 cores) into the extension module
``headlab.attention.backends._onepass``; :func:`kernel` imports it (nothing is compiled at run
time, no lock is taken) and returns it, or None when it cannot: ``HEADLAB_NATIVE=0``, no
extension (the install found no C++ compiler), or an extension built from another version of the
C++ file (it carries the file's SHA-1, checked before it is loaded). The pure-PyTorch paths
(:mod:`headlab.attention.stats.fused`, the tiled and sparse backends' own loops, the ring's tiles)
then compute the same results, and are what the tests compare the kernel with. The kernel takes
float32 (float16 and bfloat16 compute in float32) on the CPU with no mask, ``causal``, a mask that
is one band of offsets around the diagonal (:func:`headlab.masks.band_of`: ``causal()``,
``sliding_window``, ``causal() & sliding_window(w)``, ...), or a key-padding mask (one visibility
per (batch, key)).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from headlab.environment import native_enabled
from headlab.spec.attention_spec import AttentionSpec
from headlab.spec.masks import MaskFn, band_of

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = (_CSRC / "onepass.cpp", _CSRC / "codes.cpp")
# the extension setup.py builds from _SOURCES at install time, and the tag it carries (onepass.cpp)
EXTENSION = "headlab.attention.backends._onepass"
_TAG_PREFIX = "headlab-onepass-source:"
_TAG = re.compile(re.escape(_TAG_PREFIX).encode() + rb"sha1_([0-9a-f]{40})")
REBUILD = (
    "re-run `pip install -e . --no-build-isolation` (or `make venv`) to rebuild it; meanwhile the PyTorch paths run"
)
_LOCK = threading.Lock()
_STATE: dict = {}
# A finite stand-in for -inf in the key bias: exp(NEG - m) is 0 and 0 * (NEG - m) is 0, not NaN.
NEG = -1e30
# Longest key range the kernel holds in one score block (block_q x Lk floats per thread).
MAX_KEYS = 1 << 18


def enabled() -> bool:
    """``HEADLAB_NATIVE``: ``1`` (or unset) uses the kernel, ``0`` keeps the PyTorch paths;
    any other value is a :class:`~headlab.errors.ConfigError` (:func:`headlab.environment.native_enabled`)."""
    return native_enabled()


def source_hash() -> str | None:
    """The SHA-1 of the kernel's sources as they are now (``csrc/onepass.cpp`` then ``csrc/codes.cpp``, one string
    of bytes, as ``setup.py`` hashes them; None if a file is not there)."""
    try:
        return hashlib.sha1(b"".join(p.read_bytes() for p in _SOURCES)).hexdigest()
    except OSError:
        return None


def installed() -> Path | None:
    """The extension file ``setup.py`` built (``_onepass.*.so`` beside this module), or None."""
    spec = importlib.util.find_spec(EXTENSION)
    return Path(spec.origin) if spec is not None and spec.origin else None


def built_from(path: Path) -> str | None:
    """The source SHA-1 an extension file was compiled from (the tag ``setup.py`` put in it),
    read from its bytes without loading it; None for a file without one (truncated, or not ours)."""
    found = _TAG.search(path.read_bytes())
    return found.group(1).decode() if found else None


def _load():
    """The installed extension if it was built from the source beside it; else raises
    :class:`ImportError` saying why and how to rebuild it."""
    path = installed()
    if path is None:
        raise ImportError(
            f"{EXTENSION} is not installed: the install built no kernel (no C++ compiler, or torch "
            f"not importable while building); {REBUILD}"
        )
    want, have = source_hash(), built_from(path)
    if have is None or (want is not None and have != want):
        seen = (
            "carries no source hash (a build cut short?)"
            if have is None
            else f"was built from another version of its sources, csrc/onepass.cpp and codes.cpp (sha1 {have[:12]}, the source is now {want[:12]})"
        )
        raise ImportError(f"the installed kernel {path.name} {seen}; refusing to load it: {REBUILD}")
    try:
        mod = importlib.import_module(EXTENSION)
    except ImportError as exc:  # e.g. built against another torch: undefined symbols
        raise ImportError(f"the installed kernel {path.name} does not load ({exc}); {REBUILD}") from exc
    if getattr(mod, "source_tag", None) != f"{_TAG_PREFIX}sha1_{have}":
        raise ImportError(
            f"the installed kernel {path.name} does not carry the source hash it was built with; {REBUILD}"
        )
    return mod


def kernel():
    """The compiled module, or None (see the module docstring); the error is in :func:`error`."""
    with _LOCK:
        if "module" in _STATE:
            return _STATE["module"]
        mod = None
        if enabled():
            try:
                mod = _load()
            except Exception as exc:  # noqa: BLE001  (not built, stale, or not loadable: the PyTorch path stands in)
                _STATE["error"] = f"{type(exc).__name__}: {exc}"
                if installed() is not None:  # a kernel that was built but is refused: say so once
                    print(f"headlab: not using the compiled attention kernel: {exc}", file=sys.stderr, flush=True)
        else:
            _STATE["error"] = "disabled by HEADLAB_NATIVE=0"
        _STATE["module"] = mod
        return mod


def error() -> str | None:
    """Why :func:`kernel` returned None (after a call), else None."""
    return _STATE.get("error")


def _module():
    """The built kernel; callers asked :func:`declines` first, so it is there."""
    mod = kernel()
    if mod is None:
        raise RuntimeError(f"the native kernel is not available ({error()}); ask native.declines() before calling it")
    return mod


# -- which calls the kernel takes ------------------------------------------------------------------


def window(mask) -> tuple[int, int] | None:
    """The kernel's ``(before, after)`` for a mask function that is one band of offsets around the
    diagonal (:func:`headlab.masks.band_of` ``(lo, hi)`` with ``lo <= 0 <= hi``): query ``i`` sees keys
    ``i - before .. i + after``, -1 = unbounded. None for any other mask (a band that leaves out the
    diagonal too: ``-1`` is the kernel's "unbounded")."""
    band = band_of(mask) if isinstance(mask, MaskFn) else None
    if band is None:
        return None
    lo, hi = band
    if (lo is not None and lo > 0) or (hi is not None and hi < 0):
        return None
    return (-1 if hi is None else hi, -1 if lo is None else -lo)


def _key_padding(mask, kv_len: int) -> bool:
    """Whether the mask is a key-padding mask: a bool tensor of shape ``(Bb, 1, 1, Lk)``."""
    return (
        isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and tuple(mask.shape[1:]) == (1, 1, kv_len)
    )


def declines(
    spec: AttentionSpec, mask, dtype: torch.dtype, *, dropout_p: float = 0.0, score_mod=None, own_tiles: bool = False
) -> str | None:
    """Why the kernel does not take this call, or None when it does (and is built).

    Args:
        spec: the call; ``mask``: its normalised mask (None, a tensor or a mask function).
        dtype: the compute dtype (float32 for float16 / bfloat16 inputs).
        dropout_p, score_mod: the kernel has neither.
        own_tiles: the caller was given tile sizes of its own (the tiling tests reach the PyTorch
            kernels that way); the kernel chooses its own.

    Never under a dispatch mode (``FlopCounterMode``, profilers): they cannot see inside the kernel,
    so those calls run on the PyTorch paths, whose every matmul they count. The kernel is loaded (on
    first use) only when everything else allows it."""
    if torch._C._len_torch_dispatch_stack() > 0:
        return "a dispatch mode (FlopCounterMode, a profiler) is active and cannot see inside the kernel"
    if dtype != torch.float32:
        return f"it computes in float32, this call in {dtype}"
    if spec.device.type != "cpu":
        return f"it runs on the CPU, this call on {spec.device}"
    if not 0 < spec.kv_len <= MAX_KEYS:
        return f"it holds 1 to {MAX_KEYS} keys per score block, this call has {spec.kv_len}"
    if dropout_p > 0:
        return "it has no dropout"
    if score_mod is not None:
        return "it applies no score_mod"
    if own_tiles:
        return "explicit tile sizes ask for the PyTorch kernel"
    if not (mask is None or window(mask) is not None or _key_padding(mask, spec.kv_len)):
        if isinstance(mask, MaskFn):
            band = band_of(mask)
            seen = (
                f"{mask.name}: its band {band} leaves out the diagonal"
                if band is not None
                else f"{mask.name}, which is no band (masks.band_of)"
            )
        else:
            seen = f"a tensor of shape {tuple(mask.shape)}"
        return f"it walks no mask, causal, a band of offsets around the diagonal or key padding, not {seen}"
    if kernel() is None:
        return f"it is not built: {error()}"
    return None


# -- the calling convention ------------------------------------------------------------------------

# Query rows per unit and keys per chunk: a 512 KiB score chunk stays in L2 beside its key and value
# chunks; 256 rows stream each key and value once per 256 queries (128 rows: 1.13-1.18x SDPA, 256: 1.10).
BLOCK_Q, BLOCK_K = 256, 512


def unit_rows(mask, kv_len: int) -> int:
    """Query rows per unit for this call: 64 under a window bounded on both sides (a block computes
    its whole span, ``rows + 2 w`` keys for ``2 w + 1`` visible: 256 rows wasted a third of the
    matmul work at w = 256; 64 rows measured 0.087-0.093 of dense SDPA's forward + backward at 8,192
    tokens, against 0.10), else :func:`block_rows`."""
    win = window(mask)
    if win is not None and win[0] >= 0 and win[1] >= 0:
        return min(64, block_rows(kv_len))
    return block_rows(kv_len)


def block_rows(kv_len: int) -> int:
    """Query rows per unit: BLOCK_Q, fewer when the column sums' store (rows x keys) would pass 16 MiB."""
    r = max(16, min(BLOCK_Q, (1 << 22) // max(1, kv_len)))
    return 1 << (r.bit_length() - 1)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``(B, H, L, d)`` as the kernel's contiguous float32 ``(B * H, L, d)`` (a copy only when needed)."""
    B, H, L, d = t.shape
    return t.to(torch.float32).reshape(B * H, L, d).contiguous()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A per-row ``(B, H, L)`` as the kernel's contiguous float32 ``(B * H, L)``."""
    return t.to(torch.float32).reshape(-1, t.shape[-1]).contiguous()


def _key_bias(mask, like: torch.Tensor, kv_len: int) -> torch.Tensor:
    """A key-padding mask as the kernel's ``(Bb, Lk)`` additive bias (0 / NEG); empty for any other mask."""
    if not _key_padding(mask, kv_len):
        return like.new_empty(0)
    vis = mask[:, 0, 0]  # (Bb, Lk)
    return torch.zeros(vis.shape, dtype=torch.float32, device=vis.device).masked_fill_(~vis, NEG).contiguous()


def _window_args(mask) -> tuple[int, int]:
    return window(mask) or (-1, -1)


def _onepass(q, k, v, mask, scale: float, want: set[str], *, causal: bool, shift: bool) -> dict:
    """One call of the forward kernel: a dict of ``(B * H, ...)`` buffers ``lse``, ``max_weight``,
    ``entropy``, ``mean_distance``, ``argmax``, ``out``, ``received``, ``shift``."""
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    BH = B * H
    qs, kc = _flat(q), _flat(k)  # the kernel's matmul applies the scale
    vc = _flat(v) if v is not None else qs.new_empty(0)
    want_rec = "received" in want
    bufs = {name: qs.new_empty(BH, Lq) for name in ("lse", "max_weight", "entropy", "mean_distance")}
    bufs["argmax"] = torch.empty(BH, Lq, dtype=torch.long)
    bufs["out"] = qs.new_empty(BH, Lq, v.shape[-1]) if v is not None else qs.new_empty(0)
    bufs["received"] = qs.new_zeros(BH, Lk) if want_rec else qs.new_empty(0)
    bufs["shift"] = qs.new_empty(BH, Lq) if shift else qs.new_empty(0)
    _module().onepass(
        qs,
        kc,
        vc,
        _key_bias(mask, qs, Lk),
        H,
        H // Hkv,
        bool(causal),
        "entropy" in want,
        "mean_distance" in want,
        want_rec,
        "argmax" in want,
        unit_rows(mask, Lk),
        BLOCK_K,
        bufs["lse"],
        bufs["max_weight"],
        bufs["entropy"],
        bufs["mean_distance"],
        bufs["argmax"],
        bufs["out"],
        bufs["received"],
        bufs["shift"],
        *_window_args(mask),
        float(scale),
    )
    return bufs


# -- what callers get --------------------------------------------------------------------------------


def statistics(q, k, v, mask, scale: float, want: set[str], *, causal: bool) -> dict:
    """Every statistic in ``want`` (and the output with ``v``), as :mod:`headlab.attention.stats.fused`
    returns them: ``lse``, ``max_weight``, ``entropy``, ``mean_distance``, ``argmax`` ``(B, H, Lq)``,
    ``received`` ``(B, H, Lk)``, ``output`` ``(B, H, Lq, Dv)``.

    The kernel runs its work units (query head x block of rows) on torch's OpenMP threads
    (``torch.get_num_threads()``), BLAS sequential inside, with the GIL released."""
    B, H, Lq, _ = q.shape
    bufs = _onepass(q, k, v, mask, scale, want, causal=causal, shift=False)
    res = {"lse": bufs["lse"].view(B, H, Lq)}
    for name in ("max_weight", "entropy", "mean_distance", "argmax"):
        if name in want:
            res[name] = bufs[name].view(B, H, Lq)
    if v is not None:
        res["output"] = bufs["out"].view(B, H, Lq, -1)
    if "received" in want:
        res["received"] = bufs["received"].view(B, H, -1)
    return res


@dataclass(frozen=True)
class Forward:
    """The kernel's attention forward, per query row ``(B, H, Lq)`` in float32.

    A row's softmax is ``P_j = exp(S_j - m) / l``; a row that sees no key has ``out = 0``,
    ``lse = -inf``, ``m = 0`` and ``inv_l = 0``. The backward recomputes ``P`` from ``m`` and
    ``log_l`` kept apart (``S - m`` is exact near the maximum; an lse rounded once as ``m + log l``
    would cost ``eps * |lse|`` on every probability)."""

    out: torch.Tensor  # (B, H, Lq, Dv): P V
    lse: torch.Tensor  # (B, H, Lq): m + log l, the kernel's own
    m: torch.Tensor  # (B, H, Lq): the row maximum, the shift of the exponentials
    inv_l: torch.Tensor  # (B, H, Lq): 1 / l, which is also the largest weight of the row

    @property
    def log_l(self) -> torch.Tensor:
        """``log l`` ``(B, H, Lq)``, ``+inf`` on rows that see no key (then ``exp(s - m - log l) = 0``):
        what :func:`backward` reads."""
        return torch.log(self.inv_l).neg_().masked_fill_(torch.isneginf(self.lse), float("inf"))

    @property
    def l(self) -> torch.Tensor:
        """The normaliser ``l`` ``(B, H, Lq)`` in float64 (exact from ``1 / l``), 0 on rows that see no key:
        what merging the softmax with another one (the ring's online softmax) reads."""
        inv = self.inv_l.double()
        return torch.where(inv > 0, inv.reciprocal(), torch.zeros_like(inv))


def forward(q, k, v, mask, scale: float, *, causal: bool) -> Forward:
    """Attention on the kernel: q ``(B, H, Lq, D)``, k ``(B, Hkv, Lk, D)``, v ``(B, Hkv, Lk, Dv)``
    (query head ``h`` reads kv head ``h // (H // Hkv)``); ``mask`` as :func:`declines` took it."""
    B, H, Lq, _ = q.shape
    bufs = _onepass(q, k, v, mask, scale, set(), causal=causal, shift=True)
    return Forward(
        out=bufs["out"].view(B, H, Lq, -1),
        lse=bufs["lse"].view(B, H, Lq),
        m=bufs["shift"].view(B, H, Lq),
        inv_l=bufs["max_weight"].view(B, H, Lq),
    )


def backward(q, k, v, dout, m, log_l, mask, scale: float, *, causal: bool, out=None, delta=None, into=None):
    """Gradients of :func:`forward`: ``(dq (B, H, Lq, D), dk, dv (B, Hkv, Lk, .))``, float32.

    Args:
        dout: ``(B, H, Lq, Dv)``, the output's gradient.
        m, log_l: ``(B, H, Lq)`` per row, as :class:`Forward` gives them (``log l = +inf`` on rows that see
            no key), or the final ones of a softmax merged from several (the ring).
        out / delta: the forward's output, or ``delta = rowsum(dout * out)`` ``(B, H, Lq)`` itself.
        into: accumulators ``(dq, dk, dv)`` the gradients are added to (and returned); default new zeros.
    """
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    f32 = torch.float32
    qs, kc, vc, do = _flat(q), _flat(k), _flat(v), _flat(dout)
    delta = (do * _flat(out)).sum(-1) if delta is None else _rows(delta)  # (BH, Lq): rowsum(dO * O)
    if into is None:
        into = (
            q.new_zeros(B, H, Lq, D, dtype=f32),
            k.new_zeros(B, Hkv, Lk, D, dtype=f32),
            v.new_zeros(B, Hkv, Lk, Dv, dtype=f32),
        )
    # the kernel adds into its gradient buffers: a contiguous float32 accumulator is passed as it is,
    # any other is added to from a temporary
    direct = [t.dtype == f32 and t.is_contiguous() for t in into]
    bufs = [
        t.view(-1, t.shape[2], t.shape[3])
        if ok
        else torch.zeros(t.shape[0] * t.shape[1], t.shape[2], t.shape[3], dtype=f32, device=t.device)
        for t, ok in zip(into, direct)
    ]
    _module().onepass_backward(
        qs,
        kc,
        vc,
        _key_bias(mask, qs, Lk),
        H,
        H // Hkv,
        bool(causal),
        do,
        _rows(m),
        _rows(log_l),
        delta,
        unit_rows(mask, Lk),
        BLOCK_K,
        *bufs,
        *_window_args(mask),
        float(scale),
    )
    for t, g, ok in zip(into, bufs, direct):
        if not ok:
            t += g.view(t.shape).to(t.dtype)
    return into
