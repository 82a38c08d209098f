"""Checking a backend against exact attention: the FlashAttention error rule.

With ``out_ref`` computed by the reference backend in float64 and ``out_pt`` by the reference
backend in the SAME precision as the backend under test, the backend passes when

    max|out - out_ref| <= factor * max|out_pt - out_ref| + atol

with ``factor = 2`` for outputs and ``3`` for gradients (REFERENCES.md section 2). ``atol`` is a
floor for float64 and for cases where the plain implementation happens to be exact.

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

# absolute floors by dtype: below these, differences are rounding noise of the dtype itself
_ATOL = {torch.float64: 1e-10, torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}


@dataclass
class BackendReport:
    """Errors of one backend on one case: ``errors[name] = (err_backend, err_plain, bound)``."""

    backend: str
    errors: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(err <= bound for err, _, bound in self.errors.values())

    def failures(self) -> list[str]:
        return [f"{n}: |backend - ref64| = {e:.3g} > bound {b:.3g} (plain same-precision error {p:.3g})"
                for n, (e, p, b) in self.errors.items() if e > b]


def _run(backend, q, k, v, grad_out, *, mask, causal, scale, grads: bool):
    q, k, v = (t.detach().clone().requires_grad_(grads) for t in (q, k, v))
    out, _ = attention_with_weights(q, k, v, mask=mask, causal=causal, scale=scale, dropout_p=0.0,
                        backend=backend, need_weights=False)
    res = {"out": out.detach()}
    if grads:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
        res.update(dq=dq, dk=dk, dv=dv)
    return res


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
    atol: float | None = None,
) -> BackendReport:
    """Run ``backend`` and the reference (float64 and same precision) on one case; report errors.

    ``mask`` may be a tensor or a mask function; a tensor mask is moved as is.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    B, H, Lq, _ = q.shape
    grad_out = torch.randn(B, H, Lq, v.shape[-1], generator=gen, dtype=torch.float64).to(q.device)
    ref = _run("reference", q.double(), k.double(), v.double(), grad_out, mask=mask, causal=causal,
               scale=scale, grads=grads)
    plain = _run("reference", q, k, v, grad_out, mask=mask, causal=causal, scale=scale, grads=grads)
    test = _run(backend, q, k, v, grad_out, mask=mask, causal=causal, scale=scale, grads=grads)
    floor = _ATOL.get(q.dtype, 1e-6) if atol is None else atol
    name = backend if isinstance(backend, str) else getattr(backend, "name", str(backend))
    report = BackendReport(name)
    for key in ref:
        r = ref[key]
        scale_ref = max(1.0, float(r.abs().max()))
        e_test = float((test[key].double() - r).abs().max())
        e_plain = float((plain[key].double() - r).abs().max())
        factor = out_factor if key == "out" else grad_factor
        report.errors[key] = (e_test, e_plain, factor * e_plain + floor * scale_ref)
        if not torch.isfinite(test[key]).all():
            report.errors[key] = (float("inf"), e_plain, 0.0)
    return report


def run_cli(args, capsys) -> tuple[int, str, str]:
    """Run the ``headlab`` command's real entry point (with its error rule) inside a pytest test.

    ``capsys`` is pytest's fixture. Returns ``(exit code, stdout, stderr)``.
    """
    from headlab.cli.main import main

    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out = capsys.readouterr()
    return code, out.out, out.err


__all__ = ["BackendReport", "compare_backend", "run_cli"]
