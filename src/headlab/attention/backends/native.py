"""The compiled one-pass attention kernel (``csrc/onepass.cpp``), built on first use: the output,
the log-sum-exp and every per-query statistic of :func:`headlab.attention_stats` in one pass, and
its backward. See docs/native.md.

:func:`kernel` compiles the C++ file with torch's own ``torch.utils.cpp_extension`` (once per
version of the C++ file: the build is cached under ``~/.cache/torch_extensions``, named by the
file's hash; about 30 s on 2 cores) and
returns the module, or None when it cannot (no compiler, ``HEADLAB_NATIVE=0``): the pure-PyTorch
paths (:mod:`headlab.attention.stats.fused`, the tiled and sparse backends' own loops) then compute
the same results, and are what the tests compare the kernel with. The kernel takes float32 inputs
on the CPU with no mask, ``causal``, a plain ``masks.causal()`` or ``masks.sliding_window``, or a
key-padding mask (one visibility per (batch, key)); every other call runs on the PyTorch paths.
Users: the statistics (method ``"tiled"``), the tiled backend at its default tile sizes and the
sparse backend for plain windows, forward and backward.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

from headlab.attention.masks import MaskFn
from headlab.attention.spec import AttentionSpec

_SOURCE = Path(__file__).resolve().parent / "csrc" / "onepass.cpp"
_LOCK = threading.Lock()
_STATE: dict = {}
# A finite stand-in for -inf in the key bias: exp(NEG - m) is 0 and 0 * (NEG - m) is 0, not NaN.
NEG = -1e30
# Longest key range the kernel holds in one score block (block_q x Lk floats per thread).
MAX_KEYS = 1 << 18


def enabled() -> bool:
    """``HEADLAB_NATIVE``: ``1`` (or unset) builds and uses the kernel, ``0`` keeps the PyTorch paths;
    any other value is a :class:`~headlab.errors.ConfigError` (the CLI reads it before any work)."""
    raw = os.environ.get("HEADLAB_NATIVE", "").strip()
    if raw not in ("", "0", "1"):
        from headlab.errors import ConfigError

        raise ConfigError(f"HEADLAB_NATIVE={raw!r} is not 0 or 1; set HEADLAB_NATIVE=0 to use the PyTorch paths "
                          "only, 1 (or unset it) to use the compiled kernel")
    return raw != "0"


def kernel():
    """The compiled module, or None (see the module docstring); the error is in :func:`error`."""
    with _LOCK:
        if "module" in _STATE:
            return _STATE["module"]
        mod = None
        if enabled():
            try:
                from torch.utils.cpp_extension import load

                cap = torch.backends.cpu.get_cpu_capability()
                flags = ["-O3", "-march=native", "-fopenmp"]
                if cap in ("AVX2", "AVX512"):
                    flags += [f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}"]
                # one build per version of the source: two checkouts (or a test run beside an edit)
                # never load each other's kernel, whose signature may differ
                name = "headlab_onepass_" + hashlib.sha1(_SOURCE.read_bytes()).hexdigest()[:12]
                build = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
                if not any(build.glob(f"*/{name}/*.so")):
                    print("headlab: compiling the native attention kernel (once per machine and kernel version, about 30 s)",
                          file=sys.stderr, flush=True)
                mod = load(name=name, sources=[str(_SOURCE)], extra_cflags=flags, verbose=False)
            except Exception as exc:  # no compiler, no ninja, a build error: the PyTorch path stands in
                _STATE["error"] = f"{type(exc).__name__}: {exc}"
        else:
            _STATE["error"] = "disabled by HEADLAB_NATIVE=0"
        _STATE["module"] = mod
        return mod


def error() -> str | None:
    """Why :func:`kernel` returned None (after a call), else None."""
    return _STATE.get("error")


def window(mask) -> tuple[int, int] | None:
    """``(before, after)`` when the mask is a plain :func:`headlab.masks.causal` or
    :func:`headlab.masks.sliding_window` (query ``i`` sees keys ``i - before .. i + after``; -1:
    unbounded), else None. Read from the mask's ``band`` (its visible offsets ``i - j``), which
    those two constructors set; a composition has none."""
    band = getattr(mask, "band", None) if isinstance(mask, MaskFn) else None
    if band is None:
        return None
    lo, hi = band
    return (-1 if hi is None else hi, -1 if lo is None else -lo)


def _key_padding(spec: AttentionSpec, mask) -> bool:
    """Whether the mask is a key-padding mask: a bool tensor of shape ``(Bb, 1, 1, Lk)``."""
    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4
            and tuple(mask.shape[1:]) == (1, 1, spec.kv_len))


def key_bias(spec: AttentionSpec, mask) -> torch.Tensor | None:
    """A key-padding mask (:func:`usable` checked it) as a ``(Bb, Lk)`` additive bias (0 / NEG);
    None without a mask or under a window (see :func:`window`)."""
    if not _key_padding(spec, mask):
        return None
    vis = mask[:, 0, 0]  # (Bb, Lk)
    return torch.zeros(vis.shape, dtype=torch.float32, device=vis.device).masked_fill_(~vis, NEG).contiguous()


def usable(spec: AttentionSpec, mask, ct: torch.dtype) -> bool:
    """Whether the kernel takes this call (the module itself is not loaded here). Never under a
    dispatch mode (``FlopCounterMode``, profilers): they cannot see inside the kernel, so those
    calls run on the PyTorch paths, whose every matmul they count."""
    if torch._C._len_torch_dispatch_stack() > 0:
        return False
    return (ct == torch.float32 and spec.device.type == "cpu" and 0 < spec.kv_len <= MAX_KEYS
            and (mask is None or window(mask) is not None or _key_padding(spec, mask)))


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


def native_stats(mod, q, k, v, spec: AttentionSpec, mask, scale: float, want: set[str], *,
                 shift: bool = False) -> dict:
    """Every statistic in ``want`` (and the output with ``v``) from the kernel, as :mod:`.fused` returns them.

    The kernel runs its work units (query head x block of rows) on torch's OpenMP threads
    (``torch.get_num_threads()``), BLAS sequential inside, with the GIL released."""
    B, H, Lq, D = q.shape
    Hkv, Lk = spec.kv_heads, spec.kv_len
    BH = B * H
    qs = q.to(torch.float32).reshape(BH, Lq, D).contiguous()  # the kernel's matmul applies the scale
    kc = k.to(torch.float32).reshape(B * Hkv, Lk, D).contiguous()
    vc = v.to(torch.float32).reshape(B * Hkv, Lk, v.shape[-1]).contiguous() if v is not None else qs.new_empty(0)
    bias = key_bias(spec, mask)
    bias = qs.new_empty(0) if bias is None else bias
    bq = unit_rows(mask, Lk)
    outs = [qs.new_empty(BH, Lq) for _ in range(4)] + [torch.empty(BH, Lq, dtype=torch.long)]
    out = qs.new_empty(BH, Lq, v.shape[-1]) if v is not None else qs.new_empty(0)
    want_rec = "received" in want
    sh = qs.new_empty(BH, Lq) if shift else qs.new_empty(0)
    rec = qs.new_zeros(BH, Lk) if want_rec else qs.new_empty(0)
    mod.onepass(qs, kc, vc, bias, H, spec.group, bool(spec.causal), "entropy" in want, "mean_distance" in want,
                want_rec, "argmax" in want, bq, BLOCK_K, *outs, out, rec, sh, *(window(mask) or (-1, -1)),
                float(scale))
    lse, mw, ent, md, arg = outs
    shape = (B, H, Lq)
    res = {"lse": lse.view(shape)}
    for name, t in (("max_weight", mw), ("entropy", ent), ("mean_distance", md), ("argmax", arg)):
        if name in want:
            res[name] = t.view(shape)
    if v is not None:
        res["output"] = out.view(B, H, Lq, -1)
    if shift:
        res["shift"], res["max_weight"] = sh.view(shape), mw.view(shape)
    if want_rec:
        res["received"] = rec.view(B, H, Lk)
    return res


def forward_with_shift(mod, q, k, v, spec: AttentionSpec, mask, scale: float):
    """The output ``(B, H, Lq, Dv)`` and ``ml (B, H, Lq, 2)`` = ``[m, log l]`` per row (``m = 0``,
    ``log l = +inf`` on rows that see no key): what the tiled and sparse backwards recompute from."""
    res = native_stats(mod, q, k, v, spec, mask, scale, {"lse"}, shift=True)
    dead = torch.isneginf(res["lse"])  # (B, H, Lq)
    log_l = torch.log(res["max_weight"]).neg_().masked_fill_(dead, float("inf"))  # log l = -log(1 / l)
    return res["output"], torch.stack([res["shift"], log_l], -1)


def native_backward(mod, q, k, v, out, dout, shift, log_l, spec: AttentionSpec, mask, scale: float):
    """Gradients of the kernel's forward: ``dq (B, H, Lq, D)``, ``dk``, ``dv`` ``(B, Hkv, Lk, .)``
    in float32, from the forward's output and its per-row ``shift`` and ``log_l`` ``(B, H, Lq)``
    (``log l = +inf`` on rows that see no key). Same masks as the forward."""
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = spec.kv_heads, spec.kv_len, v.shape[-1]
    f32 = torch.float32
    qs = q.to(f32).reshape(B * H, Lq, D).contiguous()
    kc = k.to(f32).reshape(B * Hkv, Lk, D).contiguous()
    vc = v.to(f32).reshape(B * Hkv, Lk, Dv).contiguous()
    do = dout.to(f32).reshape(B * H, Lq, Dv).contiguous()
    delta = (do * out.to(f32).reshape(B * H, Lq, Dv)).sum(-1)  # (BH, Lq): rowsum(dO * O)
    bias = key_bias(spec, mask)
    bias = qs.new_empty(0) if bias is None else bias
    dq, dk, dv = torch.zeros_like(qs), torch.zeros_like(kc), torch.zeros_like(vc)
    mod.onepass_backward(qs, kc, vc, bias, H, spec.group, bool(spec.causal), do,
                         shift.to(f32).reshape(B * H, Lq).contiguous(), log_l.to(f32).reshape(B * H, Lq).contiguous(),
                         delta, unit_rows(mask, Lk), BLOCK_K, dq, dk, dv, *(window(mask) or (-1, -1)), float(scale))
    return dq.view(B, H, Lq, D), dk.view(B, Hkv, Lk, D), dv.view(B, Hkv, Lk, Dv)
