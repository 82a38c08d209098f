"""KIVI's quantizer for the KV cache (Liu et al. 2024): asymmetric min-max groups, codes packed in bytes.

A group of numbers ``x`` is stored as ``bits``-bit codes and two numbers in the cache's dtype,

    scale = (max x - min x) / (2^bits - 1),   zero = min x,   code = clamp(round((x - zero) / scale), 0, 2^bits - 1)

and read back as ``code * scale + zero`` (a group whose numbers are all equal has scale 0 and reads back as
its value). Keys are quantized **per channel** (a group is ``group`` tokens of one channel: keys have outlier
channels, so a channel's range is narrow), values **per token** (a group is ``group`` channels of one token).
The scale and zero point are rounded to the cache's dtype first and the codes computed from the rounded
ones, so reading back needs nothing but what is stored. Codes are packed along the last dimension,
``8 // bits`` to a byte (the first code in the low bits).

Written here rather than taken from a library: optimum-quanto quantizes weights (its activation types are
8-bit only), and builds its C++ kernels at first use; HQQ's quantizer optimises its zero points
(half-quadratic), so its values are not KIVI's min-max. Neither knows a cache that evicts tokens head by
head or keeps a full-precision residual; the whole of KIVI's storage is the twenty lines below.
:func:`hadamard` is the rotation QuaRot (Ashkboos et al. 2024) turns numbers by before quantizing them.

    >>> import torch
    >>> from headlab.decode.quant import quantize_keys, dequantize_keys
    >>> x = torch.tensor([[0.0, 1.0, 5.0, 0.0], [1.5, -1.0, 5.0, 1.0], [3.0, 0.0, 5.0, 2.0], [0.75, 2.0, 5.0, 3.0]])
    >>> codes, scale, zero = quantize_keys(x[None, None], bits=2)   # 4 tokens, 4 channels: one group per channel
    >>> codes.shape, scale.flatten().tolist(), zero.flatten().tolist()   # 4 codes of 2 bits to a byte
    (torch.Size([1, 1, 4, 1]), [1.0, 1.0, 0.0, 1.0], [0.0, -1.0, 5.0, 0.0])
    >>> dequantize_keys(codes, scale, zero, bits=2, group=4)[0, 0].tolist()
    [[0.0, 1.0, 5.0, 0.0], [2.0, -1.0, 5.0, 1.0], [3.0, 0.0, 5.0, 2.0], [1.0, 2.0, 5.0, 3.0]]
"""

from __future__ import annotations

import math

import torch

from headlab.errors import ConfigError

__all__ = [
    "dequantize_keys",
    "dequantize_values",
    "hadamard",
    "pack",
    "quantize_keys",
    "quantize_values",
    "unpack",
]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., d)`` integer codes below ``2^bits`` -> ``(..., d * bits / 8)`` uint8."""
    per = 8 // bits
    c = codes.to(torch.uint8)
    if per == 1:
        return c
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack`: ``(..., d * bits / 8)`` uint8 -> ``(..., d)`` uint8 codes."""
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    c = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _minmax_codes(x: torch.Tensor, dim: int, bits: int):
    """Codes, scale and zero of ``x`` with one group along ``dim`` (kept as size 1 in scale and zero)."""
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).to(x.dtype)
    zero = lo.to(x.dtype)
    s = scale.float()
    codes = torch.round((xf - zero.float()) / torch.where(s == 0, torch.ones_like(s), s)).clamp_(0, levels)
    return codes, scale, zero


def quantize_keys(
    x: torch.Tensor, bits: int, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys per channel in groups of ``group`` tokens (default: all of ``x``'s tokens, one group): ``x (B, h, t,
    d)`` -> packed codes ``(B, h, t, d * bits / 8)``, scale and zero ``(B, h, t / group, d)``."""
    B, h, t, d = x.shape
    group = t if group is None else group
    codes, scale, zero = _minmax_codes(x.reshape(B, h, t // group, group, d), 3, bits)
    return pack(codes.reshape(B, h, t, d), bits), scale.squeeze(3), zero.squeeze(3)


def dequantize_keys(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *, bits: int, group: int = 1
) -> torch.Tensor:
    """Keys read back: ``codes (B, h, t, d * bits / 8)``; ``scale``, ``zero (B, h, t / group, d)``, one row per
    ``group`` consecutive tokens (``group=1``: a row per token, as gathered by the cache)."""
    c = unpack(codes, bits)
    if group != 1:
        scale, zero = scale.repeat_interleave(group, dim=2), zero.repeat_interleave(group, dim=2)
    return (c.float() * scale.float() + zero.float()).to(scale.dtype)


def quantize_values(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values per token in groups of ``group`` channels: ``x (B, h, t, d)`` -> packed codes ``(B, h, t, d * bits
    / 8)``, scale and zero ``(B, h, t, d / group)``."""
    B, h, t, d = x.shape
    codes, scale, zero = _minmax_codes(x.reshape(B, h, t, d // group, group), 4, bits)
    return pack(codes.reshape(B, h, t, d), bits), scale.squeeze(4), zero.squeeze(4)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *, bits: int) -> torch.Tensor:
    """Values read back: ``codes (B, h, t, d * bits / 8)``, ``scale``, ``zero (B, h, t, d / group)``."""
    c = unpack(codes, bits)
    B, h, t, d = c.shape
    g = scale.shape[-1]
    out = c.reshape(B, h, t, g, d // g).float() * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return out.reshape(B, h, t, d).to(scale.dtype)


def hadamard(n: int) -> torch.Tensor:
    """The normalised Sylvester-Hadamard matrix of size ``n`` (a power of 2): symmetric and orthogonal.

    >>> h = hadamard(4)
    >>> bool((h @ h.T - torch.eye(4)).abs().max() < 1e-6), float(h[1, 1])
    (True, -0.5)
    """
    from scipy.linalg import hadamard as sylvester

    if n < 1 or n & (n - 1):
        raise ConfigError(f"head dim {n} is not a power of 2: no Hadamard rotation")
    return torch.from_numpy(sylvester(n)).float() / math.sqrt(n)
