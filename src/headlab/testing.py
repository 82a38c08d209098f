"""Checking a backend against exact attention: the FlashAttention error rule.

Three computations of one case: ``ref`` in float64, ``plain`` a plain materialised
implementation in the SAME precision as the backend under test (independent of headlab's
backends, computing in another order: the scale is applied to K, flash-attention's
``reorder_ops``), and the backend itself. The backend passes when, for the output and for each
gradient,

    max|out - ref|  <= factor * max|plain - ref| + floor
    mean|out - ref| <= mean_factor * mean|plain - ref| + floor

with ``factor = 2`` for outputs and ``3`` for gradients, ``mean_factor = 1.5`` in float16 and
bfloat16 (flash-attention's mean bound: there the kernel accumulates in float32 and the plain
implementation does not) and ``mean_factor = factor`` in float32 and float64, where both round
alike (torch's own fused kernel is 2.6x the plain mean error on dv at scale 16), and
flash-attention's own floor
``floor = 2 * max|(ref + 0.3 - 0.3) - ref|`` evaluated in the low precision (the rounding of
the dtype at the size of the values; about 1e-7 for float32 values near 1). No larger floor:
a backend 10x worse than the plain implementation fails. (float64, which has no more precise
oracle, is held to 1e3 ulps instead: see :func:`flash_floor`.)

    >>> import torch, headlab
    >>> from headlab.testing import compare_backend
    >>> q, k, v = (torch.randn(1, 4, 33, 16) for _ in range(3))
    >>> report = compare_backend("sdpa", q, k, v, causal=True)
    >>> report.ok, sorted(report.errors)
    (True, ['dk', 'dq', 'dv', 'out'])
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from headlab.attention.core import attention_with_weights
from headlab.spec.attention_spec import default_scale, validate
from headlab.spec.visibility import additive_bias


@dataclass
class BackendReport:
    """Errors of one backend on one case: ``errors[name] = (err_backend, err_plain, bound)`` (max
    norms) and ``means[name] = (mean_err_backend, mean_err_plain, bound)``."""

    backend: str
    errors: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    means: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(err <= bound for err, _, bound in (*self.errors.values(), *self.means.values()))

    def ratios(self) -> dict[str, float]:
        """``max|backend - ref| / max|plain - ref|`` per quantity (the plain error floored at the
        flash floor, so that an exact plain implementation does not divide by zero)."""
        return {n: e / max(p, self.floors.get(n, 0.0), 1e-300) for n, (e, p, b) in self.errors.items()}

    def failures(self) -> list[str]:
        out = [
            f"{n}: max|backend - ref64| = {e:.3g} > bound {b:.3g} (plain same-precision error {p:.3g})"
            for n, (e, p, b) in self.errors.items()
            if e > b
        ]
        out += [
            f"{n}: mean|backend - ref64| = {e:.3g} > bound {b:.3g} (plain mean error {p:.3g})"
            for n, (e, p, b) in self.means.items()
            if e > b
        ]
        return out


def plain_attention(q, k, v, *, mask=None, causal=False, scale=None, reorder_ops=True, score_mod=None):
    """``softmax(q (k * scale)^T + M) v`` materialised in the input dtype with plain torch ops,
    GQA by repeating K/V; rows that see no key are zeros. With ``reorder_ops`` (the default) the
    scale goes on K (flash-attention's ``reorder_ops``) and each dot product sums its head_dim
    products in reverse order, so that it differs from every backend's order even when the scale
    is a power of two (then scaling K is exact and alone would change nothing). Written apart from headlab's backends
    (only the mask normalisation is shared), the yardstick of :func:`compare_backend`."""
    spec, norm = validate(q, k, v, mask=mask, causal=causal)
    scale = default_scale(spec.head_dim) if scale is None else float(scale)
    kk = k.repeat_interleave(spec.group, dim=1)  # (B, H, Lk, D)
    vv = v.repeat_interleave(spec.group, dim=1)
    if reorder_ops:  # the scale on K, and the products of each dot product summed in reverse order
        s = q.flip(-1) @ (kk * scale).flip(-1).transpose(-1, -2)  # (B, H, Lq, Lk)
    else:
        s = (q * scale) @ kk.transpose(-1, -2)
    if score_mod is not None:
        B, H, Lq, Lk = s.shape
        s = score_mod(
            s,
            torch.arange(B).view(B, 1, 1, 1),
            torch.arange(H).view(1, H, 1, 1),
            torch.arange(Lq).view(1, 1, Lq, 1),
            torch.arange(Lk).view(1, 1, 1, Lk),
        )
    bias = additive_bias(spec, norm, dtype=s.dtype)
    if bias is not None:
        s = s + bias
    dead = torch.isneginf(s).all(-1, keepdim=True)  # (B, H, Lq, 1): rows that see no key
    s = s.masked_fill(dead, 0.0)
    p = torch.softmax(s, -1)
    return (p @ vv).masked_fill(dead, 0.0)


def _run(fn, q, k, v, grad_out, grads: bool):
    q, k, v = (t.detach().clone().requires_grad_(grads) for t in (q, k, v))
    out = fn(q, k, v)
    res = {"out": out.detach()}
    if grads:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
        res.update(dq=dq, dk=dk, dv=dv)
    return res


def flash_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """flash-attention's absolute floor ``2 * max|(ref + 0.3 - 0.3) - ref|`` in ``dtype``.

    float64 has no more precise oracle: the float64 reference and the plain float64
    implementation differ by rounding only, so the rule's yardstick is noise there; float64 is
    held to ``1e3`` ulps of ``max(1, |ref|)`` instead (``2.2e-13``)."""
    if dtype == torch.float64:
        return 1e3 * torch.finfo(torch.float64).eps * max(1.0, float(ref.abs().max())) if ref.numel() else 0.0
    r = ref.to(dtype)
    return 2.0 * float(((r + 0.3 - 0.3) - r).abs().max().double()) if r.numel() else 0.0


def compare_backend(
    backend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask=None,
    causal: bool = False,
    scale: float | None = None,
    grads: bool = True,
    out_factor: float = 2.0,
    grad_factor: float = 3.0,
    mean_factor: float | None = None,
    score_mod=None,
) -> BackendReport:
    """Run ``backend``, the float64 reference and the plain same-precision implementation on one
    case; report errors and bounds (see the module docstring).

    ``mask`` may be a bool or additive float tensor or a mask function; a tensor mask is moved as
    is (a float mask is cast with the inputs).
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    B, H, Lq, _ = q.shape
    grad_out = torch.randn(B, H, Lq, v.shape[-1], generator=gen, dtype=torch.float64).to(q.device)

    def mask_as(dt):
        return mask.to(dt) if isinstance(mask, torch.Tensor) and mask.is_floating_point() else mask

    def call(be, dt):
        def fn(qq, kk, vv):
            out, _ = attention_with_weights(
                qq,
                kk,
                vv,
                mask=mask_as(dt),
                causal=causal,
                scale=scale,
                backend=be,
                need_weights=False,
                score_mod=score_mod,
            )
            return out

        return fn

    ref = _run(call("reference", torch.float64), q.double(), k.double(), v.double(), grad_out, grads)
    plain = _run(
        lambda a, b, c: plain_attention(
            a, b, c, mask=mask_as(q.dtype), causal=causal, scale=scale, score_mod=score_mod
        ),
        q,
        k,
        v,
        grad_out,
        grads,
    )
    test = _run(call(backend, q.dtype), q, k, v, grad_out, grads)
    name = backend if isinstance(backend, str) else getattr(backend, "name", str(backend))
    report = BackendReport(name)
    for key in ref:
        r = ref[key]
        floor = report.floors[key] = flash_floor(r, q.dtype)
        d_test = (test[key].double() - r).abs()
        d_plain = (plain[key].double() - r).abs()
        e_test, e_plain = float(d_test.max()), float(d_plain.max())
        factor = out_factor if key == "out" else grad_factor
        report.errors[key] = (e_test, e_plain, factor * e_plain + floor)
        mf = mean_factor if mean_factor is not None else (1.5 if q.dtype in (torch.float16, torch.bfloat16) else factor)
        report.means[key] = (float(d_test.mean()), float(d_plain.mean()), mf * float(d_plain.mean()) + floor)
        if not torch.isfinite(test[key]).all():
            report.errors[key] = (float("inf"), e_plain, 0.0)
    return report


__all__ = ["BackendReport", "compare_backend", "flash_floor", "plain_attention"]
