"""The compiled kernel's decode attention on KIVI's packed codes (``csrc/codes.cpp``, built into the same extension
as the one-pass kernel): :func:`key_scores` and :func:`value_output`, the two products of
:mod:`headlab.decode.codes`, one pass over the codes each, in float32, with no unpacked copy of the cache.

Each returns None when the kernel does not take the call (not built, ``HEADLAB_NATIVE=0``, a tensor off the CPU,
a storage dtype it does not read), and :mod:`headlab.decode.codes` computes the same numbers in PyTorch (what the
tests compare the kernel with)::

    scores = native_codes.key_scores(qf, codes, scale, zero, bits=4, group=32, head=32)   # (B, h, r, t) or None
    out = native_codes.value_output(p, codes, scale, zero, bits=4)                       # (B, h, r, dv) or None

and :func:`quantize_values`, KIVI's per-token quantizer (:func:`headlab.decode.quant.quantize_values`, the same
numbers) in one call, for the value a decode step stores.
"""

from __future__ import annotations

import torch

from headlab.attention.backends import native

__all__ = ["key_scores", "quantize_values", "value_output"]

_READS = (torch.float32, torch.float16, torch.bfloat16)  # the storage dtypes of scales and zeros it reads


def _takes(*tensors: torch.Tensor) -> bool:
    if not all(t.device.type == "cpu" for t in tensors) or tensors[2].dtype not in _READS:
        return False
    return native.kernel() is not None


def key_scores(qf, codes, scale, zero, *, bits: int, group: int, head: int) -> torch.Tensor | None:
    """``qf (B, h, r, d)`` float32 on quantized keys ``codes (B, h, t, d * bits / 8)``, scale and zero rows ``(B, h,
    G, d)`` (the first covering ``head`` tokens, the rest ``group`` each): ``(B, h, r, t)`` float32 ``q . k``."""
    if not _takes(qf, codes, scale, zero):
        return None
    B, h, r, d = qf.shape
    t = codes.shape[2]
    out = native.kernel().codes_key_scores(
        qf.reshape(B * h, r, d).contiguous(),
        codes.reshape(B * h, t, -1).contiguous(),
        scale.reshape(B * h, -1, d).contiguous(),
        zero.reshape(B * h, -1, d).to(scale.dtype).contiguous(),
        bits,
        group,
        head,
    )
    return out.reshape(B, h, r, t)


def value_output(p, codes, scale, zero, *, bits: int) -> torch.Tensor | None:
    """Weights ``p (B, h, r, t)`` float32 on quantized values ``codes (B, h, t, dv * bits / 8)``, scale and zero
    ``(B, h, t, G)``: ``(B, h, r, dv)`` float32."""
    if not _takes(p, codes, scale, zero):
        return None
    B, h, r, t = p.shape
    out = native.kernel().codes_value_output(
        p.reshape(B * h, r, t).contiguous(),
        codes.reshape(B * h, t, -1).contiguous(),
        scale.reshape(B * h, t, -1).contiguous(),
        zero.reshape(B * h, t, -1).to(scale.dtype).contiguous(),
        bits,
    )
    return out.reshape(B, h, r, -1)


def quantize_values(x: torch.Tensor, bits: int, group: int):
    """``x (B, h, t, dv)`` in the storage dtype -> packed codes ``(B, h, t, dv * bits / 8)``, scale and zero ``(B, h,
    t, dv / group)``, as :func:`headlab.decode.quant.quantize_values` computes them; None when declined."""
    if x.device.type != "cpu" or x.dtype not in _READS or native.kernel() is None:
        return None
    B, h, t, dv = x.shape
    codes, scale, zero = native.kernel().codes_quantize_values(x.reshape(-1, dv).contiguous(), bits, dv // group)
    return codes.reshape(B, h, t, -1), scale.reshape(B, h, t, -1), zero.reshape(B, h, t, -1)
