"""Score modifications: *how* the scores that count are changed (FlexAttention's ``score_mod``).

A score_mod is ``f(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled scores
``q k^T * scale`` before the mask and the softmax; the index tensors broadcast against the
score tile. Any plain function works where a score_mod is expected; the ready ones below are
:class:`ScoreMod` objects that also tell a kernel whether their derivative with respect to the
score is 1 (``additive``: a bias, so the backward pass needs no autograd through it).

    >>> import torch, headlab
    >>> from headlab import masks
    >>> q, k, v = (torch.randn(1, 4, 6, 8) for _ in range(3))
    >>> out = headlab.attention(q, k, v, causal=True, score_mod=masks.alibi(masks.alibi_slopes(4)),
    ...                         backend="reference")
    >>> out.shape
    torch.Size([1, 4, 6, 8])

Supported by the ``reference``, ``tiled`` and ``sparse`` backends, forward and backward, see
``headlab.backends()``. A table or slopes given as tensors that require grad (a learned relative
bias) get their gradient on all three: a ScoreMod lists them in ``tensors``, and the tiled and
sparse kernels add up each tile's vector-Jacobian product for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from headlab.errors import ConfigError

__all__ = ["ScoreMod", "alibi", "alibi_slopes", "as_score_mod", "bias_tensor", "param_vjp", "relative_bias", "softcap"]


class ScoreMod:
    """A named ``f(score, b, h, q_idx, kv_idx) -> score``.

    Args:
        fn: the modification, written with broadcasting tensor operations.
        name: shown in ``repr``.
        additive: True when ``fn(s, ...) = s + bias(b, h, q_idx, kv_idx)`` (derivative 1).
        tensors: the tensors ``fn`` reads that may require grad (their gradients are returned).
    """

    def __init__(
        self, fn: Callable, name: str = "score_mod", *, additive: bool = False, tensors: tuple[torch.Tensor, ...] = ()
    ) -> None:
        self._fn = fn
        self.name = name
        self.additive = additive
        self.tensors = tuple(tensors)  # the tensors fn reads that may need a gradient (a learned table)

    def trainable(self) -> tuple[torch.Tensor, ...]:
        """The tensors of :attr:`tensors` that require grad (the kernels return their gradients)."""
        return tuple(t for t in self.tensors if t.requires_grad)

    def __call__(self, score, b, h, q_idx, kv_idx):
        out = self._fn(score, b, h, q_idx, kv_idx)
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"score_mod {self.name!r} returned {type(out).__name__}, expected a tensor")
        return torch.broadcast_to(out, score.shape) if out.shape != score.shape else out

    def __repr__(self) -> str:
        return f"ScoreMod({self.name})"


def as_score_mod(f) -> ScoreMod:
    """Wrap a plain ``f(score, b, h, q_idx, kv_idx)`` (assumed not additive)."""
    if isinstance(f, ScoreMod):
        return f
    if not callable(f):
        raise ConfigError(
            f"score_mod must be a function f(score, b, h, q_idx, kv_idx) -> score, got {type(f).__name__}"
        )
    return ScoreMod(f, getattr(f, "__name__", "score_mod"))


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al. 2022): ``2^(-8 i / n)`` for ``i = 1..n`` when ``heads`` is a
    power of two ``n``, else the power-of-two list interleaved as in the paper's code."""
    if not isinstance(heads, int) or heads <= 0:
        raise ConfigError(f"alibi_slopes needs a positive number of heads, got {heads!r}")

    def pow2(n):
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if heads & (heads - 1) == 0:
        return torch.tensor(pow2(heads), dtype=torch.float64)
    n = 2 ** math.floor(math.log2(heads))
    extra = pow2(2 * n)[0::2][: heads - n]
    return torch.tensor(pow2(n) + extra, dtype=torch.float64)


def alibi(slopes) -> ScoreMod:
    """ALiBi (Press et al. 2022): ``score + slope[h] * (kv_idx - q_idx)``, a linear penalty on
    distance (pair it with ``causal=True`` as in the paper; for keys after the query the bias is
    positive, as in the formula).

    Args:
        slopes: one slope per query head, e.g. :func:`alibi_slopes` ``(heads)``.
    """
    sl = torch.as_tensor(slopes, dtype=torch.float64).flatten()
    if sl.numel() == 0:
        raise ConfigError("alibi needs one slope per head, got none")

    def fn(score, b, h, q, kv):
        return score + sl.to(score.device, score.dtype)[h] * (kv - q).to(score.dtype)

    return ScoreMod(fn, f"alibi({sl.numel()} heads)", additive=True, tensors=(sl,))


def softcap(cap: float) -> ScoreMod:
    """Tanh soft-capping (Gemma 2's ``attn_logit_softcapping``): ``cap * tanh(score / cap)``;
    scores stay inside ``(-cap, cap)``.

    Args:
        cap: the cap, a positive finite number (Gemma 2 uses 50).
    """
    c = float(cap)
    if not math.isfinite(c) or c <= 0:
        raise ConfigError(f"softcap needs a positive finite cap, got {cap!r}")

    def fn(score, b, h, q, kv):
        return torch.tanh(score / c) * c

    return ScoreMod(fn, f"softcap({c:g})")


def relative_bias(table) -> ScoreMod:
    """A learned relative position bias (T5 / Shaw et al. style, unbucketed):
    ``score + table[h, clamp(kv_idx - q_idx + R, 0, 2R)]``.

    Args:
        table: ``(heads, 2R + 1)`` biases for offsets ``-R..R`` (offsets beyond clamp to the ends),
            or ``(2R + 1,)`` shared by every head.
    """
    t = torch.as_tensor(table)
    if not t.is_floating_point() or t.dim() not in (1, 2) or t.shape[-1] % 2 == 0:
        raise ConfigError(f"relative_bias needs a float (heads, 2R+1) or (2R+1,) table, got {tuple(t.shape)} {t.dtype}")
    R = (t.shape[-1] - 1) // 2

    def fn(score, b, h, q, kv):
        idx = (kv - q).clamp(-R, R) + R
        tt = t.to(score.device, score.dtype)
        return score + (tt[idx] if tt.dim() == 1 else tt[h, idx])

    return ScoreMod(fn, f"relative_bias(R={R})", additive=True, tensors=(t,))


def bias_tensor(bias: torch.Tensor, name: str = "bias") -> ScoreMod:
    """An additive bias given as a tensor: ``score + bias[b, h, q_idx, kv_idx]``, with ``bias`` of shape
    ``(B or 1, H or 1, Lq or 1, Lk or 1)`` (a size-1 axis is shared). What a model computes itself and
    adds to its scores: BLOOM's and Falcon's ALiBi rows, T5's bucketed relative bias.

        >>> import torch
        >>> mod = bias_tensor(torch.tensor([0.0, 1.0, 2.0]).view(1, 1, 1, 3))
        >>> mod(torch.zeros(1, 1, 2, 3), *(torch.arange(n).view(*([1] * i), n, *([1] * (3 - i)))
        ...                               for i, n in enumerate((1, 1, 2, 3))))[0, 0]
        tensor([[0., 1., 2.],
                [0., 1., 2.]])
    """
    t = torch.as_tensor(bias)
    if not t.is_floating_point() or t.dim() != 4:
        raise ConfigError(
            f"bias_tensor needs a float (B, H, Lq, Lk) tensor (size-1 axes broadcast), got {tuple(t.shape)} {t.dtype}"
        )
    sizes = tuple(t.shape)

    def fn(score, b, h, q, kv):
        # clamped: a kernel may score padding positions past the end of a tile (they are masked after)
        idx = [i.clamp(0, n - 1) if n > 1 else torch.zeros_like(i) for i, n in zip((b, h, q, kv), sizes)]
        return score + t.to(score.device, score.dtype)[idx[0], idx[1], idx[2], idx[3]]

    return ScoreMod(fn, f"{name}{sizes}", additive=True, tensors=(t,))


def param_vjp(score_mod, s_raw, index, params=(), grads=None):
    """``(score_mod(s_raw), vjp)`` through autograd: ``vjp(ds)`` returns ``ds * d score_mod / d s_raw``
    and adds ``d <ds, score_mod> / d param`` for the trainable ``params`` to ``grads`` (a list, one
    entry per param). The tiled and sparse backwards call it for every score_mod that is not a
    plain bias without trainable tensors."""
    with torch.enable_grad():
        x = s_raw.detach().requires_grad_(True)
        y = score_mod(x, *index)

    def vjp(ds):
        got = torch.autograd.grad(y, (x, *params), ds, allow_unused=True)
        for i, g in enumerate(got[1:]):
            if g is not None:
                grads[i] = g if grads[i] is None else grads[i] + g
        return got[0] if got[0] is not None else torch.zeros_like(x)  # a score_mod that ignores the score

    return y.detach().clone(), vjp
