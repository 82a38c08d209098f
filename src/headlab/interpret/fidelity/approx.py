"""How far an efficient variant strays from exact attention, on your own q, k, v.

:func:`compare` runs a variant (a sparse pattern on an exact backend, or an approximate
backend such as ``"linear"`` / FAVOR+) beside exact softmax attention on the same inputs and
reports:

* the relative output error ``||out - exact|| / ||exact||``, overall and per head, and the cosine;
* for sparse patterns (a mask given to an exact backend): the softmax mass that exact attention
  puts on the keys the pattern hides, per (batch, head, query): the share the pattern throws
  away. Computed in query chunks, so memory stays ``chunk x kv_len`` per head, never n x n.
  Queries that see no key under the pattern output zeros; the report counts them;
* for approximate backends that expose ``implied_weights`` (the linear backend): the error of
  the attention weights they imply, on sampled query rows (total variation distance per row,
  ``0.5 * sum_j |a_ij - p_ij|`` in [0, 1], and the largest absolute difference).

:func:`feature_sweep` shows how the FAVOR+ error falls as the number of random features grows,
over several seeds. :func:`~headlab.interpret.fidelity.model_shift.compare_model` swaps a backend into every
attention layer of a loaded model and reports how far the final hidden states move.

The exact baseline: with an exact backend, the variant's ``mask`` is the pattern and the
baseline drops it (causal is kept); with an approximate backend, the ``mask`` (key padding) is
part of the problem and the baseline keeps it. ``exact_mask=`` overrides either choice.

    >>> import torch
    >>> from headlab import masks
    >>> from headlab.interpret.fidelity.approx import compare
    >>> q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    >>> window = masks.as_mask(lambda b, h, qi, ki: (qi - ki).abs() <= 4)     # a sliding window of 9 keys
    >>> r = compare(q, k, v, backend="sdpa", mask=window)
    >>> r.mass_outside.shape, 0.5 < r.mass_outside_mean < 1, r.empty_rows  # most mass lies outside
    (torch.Size([1, 2, 64]), True, 0)
    >>> r = compare(q, k, v, backend="linear", causal=True)
    >>> 0 < r.out_rel_error < 2, len(r.out_rel_error_per_head), r.weights_tvd_mean is not None
    (True, 2, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from headlab.attention import backends as _backends
from headlab.attention.backends.linear import FEATURE_MAP_ALIASES
from headlab.attention.backends.linear import from_string as linear_from_string
from headlab.attention.core import attention as _attention_fn
from headlab.errors import ConfigError
from headlab.spec.attention_spec import default_scale, normalize_mask, validate
from headlab.spec.visibility import visible

__all__ = ["ApproxReport", "FeatureSweep", "SweepPoint", "backend_label", "compare", "feature_sweep", "resolve_backend"]

_SAME = "auto"
_CHUNK_BUDGET = 64 << 20  # bytes of one (B, H, rows, Lk) score chunk


@dataclass
class ApproxReport:
    """What :func:`compare` measured. Tensors are on the CPU; :meth:`as_dict` is JSON-ready."""

    backend: str  # the variant, e.g. "sdpa" with a pattern, "linear favor:256 seed=0"
    pattern: str | None  # the mask the variant ran with, by name
    causal: bool
    shape: tuple[int, int, int, int]  # (batch, heads, q_len, kv_len)
    out_rel_error: float  # ||out - exact|| / ||exact|| over everything
    out_rel_error_per_head: list[float]  # the same per query head
    out_cosine: float  # cosine between the flattened outputs
    empty_rows: int  # (batch, head, query) rows that see no key under the variant: zeros
    mass_outside: torch.Tensor | None = None  # (B, H, Lq): exact softmax mass on hidden keys
    sampled_rows: list[int] | None = None  # query positions whose implied weights were compared
    weights_tvd: torch.Tensor | None = None  # (B, H, rows): 0.5 * sum_j |implied - exact|
    weights_max_abs_error: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def mass_outside_mean_per_head(self) -> list[float] | None:
        if self.mass_outside is None:
            return None
        return self.mass_outside.double().mean(dim=(0, 2)).tolist()

    @property
    def mass_outside_mean(self) -> float | None:
        return None if self.mass_outside is None else float(self.mass_outside.double().mean())

    @property
    def mass_outside_max(self) -> float | None:
        return None if self.mass_outside is None else float(self.mass_outside.max())

    @property
    def weights_tvd_mean(self) -> float | None:
        return None if self.weights_tvd is None else float(self.weights_tvd.double().mean())

    @property
    def weights_tvd_per_head(self) -> list[float] | None:
        return None if self.weights_tvd is None else self.weights_tvd.double().mean(dim=(0, 2)).tolist()

    def as_dict(self) -> dict:
        return {
            "backend": self.backend,
            "pattern": self.pattern,
            "causal": self.causal,
            "shape": list(self.shape),
            "out_rel_error": self.out_rel_error,
            "out_rel_error_per_head": self.out_rel_error_per_head,
            "out_cosine": self.out_cosine,
            "empty_rows": self.empty_rows,
            "mass_outside_mean": self.mass_outside_mean,
            "mass_outside_max": self.mass_outside_max,
            "mass_outside_mean_per_head": self.mass_outside_mean_per_head,
            "sampled_rows": self.sampled_rows,
            "weights_tvd_mean": self.weights_tvd_mean,
            "weights_tvd_per_head": self.weights_tvd_per_head,
            "weights_max_abs_error": self.weights_max_abs_error,
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        lines = [
            f"{self.backend}{' with ' + self.pattern if self.pattern else ''}"
            f"{' (causal)' if self.causal else ''} vs exact softmax, shape {self.shape}:",
            f"  relative output error {self.out_rel_error:.4g} (cosine {self.out_cosine:.6f}); "
            f"per head {', '.join(f'{e:.3g}' for e in self.out_rel_error_per_head)}",
        ]
        if self.mass_outside is not None:
            lines.append(
                f"  softmax mass outside the pattern: mean {self.mass_outside_mean:.4g}, "
                f"max {self.mass_outside_max:.4g}"
            )
        if self.weights_tvd is not None:
            lines.append(
                f"  implied weights on {len(self.sampled_rows or [])} sampled rows: mean TVD "
                f"{self.weights_tvd_mean:.4g}, max |diff| {self.weights_max_abs_error:.4g}"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def resolve_backend(backend) -> _backends.Backend:
    """A backend from a registered name, a backend object or a feature-map string (``"favor:256"``)."""
    if (
        isinstance(backend, str)
        and backend not in _backends.names()
        and backend.split(":")[0].lower() in FEATURE_MAP_ALIASES
    ):
        return linear_from_string(backend)
    return _backends.get(backend)


def backend_label(be: _backends.Backend) -> str:
    """The backend's name, with its feature map's label when it has one (``"linear favor:256 seed=0"``)."""
    cfg = getattr(be, "config", None)
    return f"{be.name} {cfg.label()}" if cfg is not None and hasattr(cfg, "label") else be.name


def _visibility(mask, spec, rows: torch.Tensor) -> torch.Tensor | None:
    """Visible keys of the chosen query rows: bool broadcastable to (B, H, len(rows), Lk), or None."""
    return visible(spec, mask, rows.to(spec.device), None)


def _exact_rows(q, k, rows, visible, scale) -> torch.Tensor:
    """Exact softmax weights of the chosen rows ``(B, H, r, Lk)``; rows that see no key are 0."""
    B, H, _, D = q.shape
    Hk = k.shape[1]
    G = H // Hk
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qr = q[:, :, rows].to(cdt)  # (B, H, r, D)
    s = torch.matmul(qr.reshape(B, Hk, G * len(rows), D), k.to(cdt).transpose(-1, -2))  # (B, Hk, G*r, Lk)
    s = s.view(B, H, len(rows), -1) * scale  # (B, H, r, Lk)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
        dead = ~visible.any(-1, keepdim=True)
        s = s.masked_fill(dead, 0.0)
        return torch.softmax(s, -1).masked_fill(dead, 0.0)
    return torch.softmax(s, -1)


def _rel(a: torch.Tensor, b: torch.Tensor, dims) -> torch.Tensor:
    num = (a - b).double().pow(2).sum(dims).sqrt()
    den = b.double().pow(2).sum(dims).sqrt()
    return num / den.clamp_min(1e-300)


def compare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend,
    mask=None,
    causal: bool = False,
    scale: float | None = None,
    exact_mask=_SAME,
    sample_rows: int = 64,
    seed: int = 0,
    _exact: torch.Tensor | None = None,
) -> ApproxReport:
    """Run ``backend`` (with ``mask``) and exact attention on the same inputs; report the gap.

    Args:
        q: ``(B, H, Lq, D)``; k: ``(B, Hkv, Lk, D)``; v: ``(B, Hkv, Lk, Dv)``.
        backend: a registered name (``"sdpa"``, ``"sparse"``, ``"linear"``), a backend object
            (``LinearBackend("favor", num_features=256)``) or a feature-map string (``"favor:256"``).
        mask: the variant's mask: a pattern (mask function or bool tensor) for exact backends,
            key padding for ``linear``.
        causal, scale: as for :func:`headlab.attention`, for both sides.
        exact_mask: the baseline's mask; ``"auto"``: none for exact backends (the dense, or
            causal-only, attention), the same ``mask`` for approximate ones.
        sample_rows: query rows (drawn with ``seed``) whose implied weights are compared.

    Returns:
        an :class:`ApproxReport`. ``mass_outside`` is set when the variant's mask hides keys
        the baseline sees; ``weights_tvd`` when the backend exposes ``implied_weights``.
    """
    be = resolve_backend(backend)
    spec, norm = validate(q, k, v, mask=mask, causal=causal)
    if isinstance(exact_mask, str):
        if exact_mask != _SAME:
            raise ConfigError(f"exact_mask must be 'auto', None or a mask, got {exact_mask!r}")
        base = None if be.capabilities.exact else norm
    else:
        base = normalize_mask(exact_mask, (spec.batch, spec.heads, spec.q_len, spec.kv_len))
    scale_f = default_scale(spec.head_dim) if scale is None else float(scale)
    B, H, Lq, Lk = spec.batch, spec.heads, spec.q_len, spec.kv_len
    with torch.no_grad():
        out = _attention_fn(q, k, v, mask=norm, causal=causal, scale=scale, backend=be)
        exact = _exact if _exact is not None else _attention_fn(q, k, v, mask=base, causal=causal, scale=scale)
        per_head = _rel(out, exact, (0, 2, 3))
        overall = float(_rel(out, exact, (0, 1, 2, 3)))
        a, b = out.double().flatten(), exact.double().flatten()
        cos = float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))

        report = ApproxReport(
            backend=backend_label(be),
            pattern=getattr(mask, "name", None if mask is None else "bool mask"),
            causal=bool(causal),
            shape=(B, H, Lq, Lk),
            out_rel_error=overall,
            out_rel_error_per_head=per_head.tolist(),
            out_cosine=cos,
            empty_rows=0,
        )
        pattern = norm is not None and base is not norm
        if norm is not None:
            _scan_rows(report, q, k, spec, norm, base, pattern, scale_f)
        if report.empty_rows:
            report.notes.append(
                f"{report.empty_rows} of {B * H * Lq} (batch, head, query) rows see no key under the variant's mask: "
                "their outputs are zeros (FlashAttention's rule), not an average of values"
            )
        if hasattr(be, "implied_weights"):
            n = min(int(sample_rows), Lq)
            if n < 1:
                raise ConfigError(f"sample_rows must be >= 1, got {sample_rows}")
            gen = torch.Generator().manual_seed(int(seed))
            rows = torch.randperm(Lq, generator=gen)[:n].sort().values.to(q.device)
            implied = be.implied_weights(q, k, rows, mask=norm, causal=causal, scale=scale)
            ref = _exact_rows(q, k, rows, _visibility(base, spec, rows), scale_f)
            diff = (implied.to(ref.dtype) - ref).abs()
            report.sampled_rows = rows.tolist()
            report.weights_tvd = (0.5 * diff.sum(-1)).cpu()
            report.weights_max_abs_error = float(diff.max())
        if not be.capabilities.exact and norm is not None and base is norm:
            report.notes.append("the mask is applied on both sides (key padding is part of the problem)")
    return report


def _scan_rows(report, q, k, spec, norm, base, pattern: bool, scale: float) -> None:
    """Query chunks: count rows the variant leaves empty; with a pattern, exact mass outside it."""
    B, H, Lq, Lk = spec.batch, spec.heads, spec.q_len, spec.kv_len
    step = max(1, _CHUNK_BUDGET // max(1, B * H * Lk * 8))
    mass = torch.zeros(B, H, Lq, dtype=torch.float64) if pattern else None
    empty = 0
    for r0 in range(0, Lq, step):
        rows = torch.arange(r0, min(Lq, r0 + step), device=q.device)
        vis = _visibility(norm, spec, rows)  # (Bm, Hm, r, Lk) under the variant
        assert vis is not None  # the variant has a mask (norm is not None)
        empty += int((~vis.any(-1)).expand(B, H, len(rows)).sum())
        if pattern:
            assert mass is not None  # allocated for a pattern
            p = _exact_rows(q, k, rows, _visibility(base, spec, rows), scale)  # (B, H, r, Lk)
            mass[:, :, r0 : r0 + len(rows)] = p.masked_fill(vis, 0.0).sum(-1).double().cpu()
    report.empty_rows = empty
    if pattern:
        assert mass is not None  # allocated for a pattern
        report.mass_outside = mass.to(torch.float32)


# -- how the FAVOR+ error falls with the number of features -----------------------------------


@dataclass(frozen=True)
class SweepPoint:
    num_features: int
    out_rel_error: float  # mean over seeds
    out_rel_error_std: float
    weights_tvd: float  # mean TVD of implied weights on sampled rows, mean over seeds
    weights_tvd_std: float


@dataclass
class FeatureSweep:
    points: list[SweepPoint]
    seeds: list[int]
    slope: float  # least-squares slope of log(error) vs log(features); Monte Carlo: about -0.5

    def as_dict(self) -> dict:
        return {"seeds": self.seeds, "slope": self.slope, "points": [p.__dict__ for p in self.points]}

    def summary(self) -> str:
        lines = ["features  out rel. error        weights TVD"]
        lines += [
            f"{p.num_features:>8}  {p.out_rel_error:.4f} +- {p.out_rel_error_std:.4f}   "
            f"{p.weights_tvd:.4f} +- {p.weights_tvd_std:.4f}"
            for p in self.points
        ]
        lines.append(f"log-log slope {self.slope:.3f} (random features: about -0.5)")
        return "\n".join(lines)


def feature_sweep(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_features: Sequence[int] = (16, 32, 64, 128, 256, 512),
    seeds: Sequence[int] = (0, 1, 2),
    mask=None,
    causal: bool = False,
    scale: float | None = None,
    sample_rows: int = 64,
) -> FeatureSweep:
    """FAVOR+ error against exact softmax for each feature count, mean and spread over seeds.

    Shapes as in :func:`compare`. The exact output is computed once.

        >>> import torch
        >>> q, k, v = (0.5 * torch.randn(1, 2, 32, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
        >>> sw = feature_sweep(q, k, v, num_features=[8, 512], seeds=[0, 1])
        >>> sw.points[1].out_rel_error < sw.points[0].out_rel_error, sw.slope < 0
        (True, True)
    """
    from headlab.attention.backends.linear import LinearBackend

    if not num_features or not seeds:
        raise ConfigError("feature_sweep needs at least one feature count and one seed")
    with torch.no_grad():
        exact = _attention_fn(q, k, v, mask=mask, causal=causal, scale=scale)
    points = []
    for m in num_features:
        errs, tvds = [], []
        for s in seeds:
            be = LinearBackend("favor", num_features=int(m), seed=int(s))
            r = compare(
                q,
                k,
                v,
                backend=be,
                mask=mask,
                causal=causal,
                scale=scale,
                sample_rows=sample_rows,
                seed=int(s),
                _exact=exact,
            )
            errs.append(r.out_rel_error)
            tvds.append(r.weights_tvd_mean)
        e, t = torch.tensor(errs, dtype=torch.float64), torch.tensor(tvds, dtype=torch.float64)
        sd = lambda x: float(x.std()) if len(x) > 1 else 0.0
        points.append(SweepPoint(int(m), float(e.mean()), sd(e), float(t.mean()), sd(t)))
    slope = float("nan")
    if len(points) > 1:
        x = torch.tensor([math.log(p.num_features) for p in points], dtype=torch.float64)
        y = torch.tensor([math.log(max(p.out_rel_error, 1e-300)) for p in points], dtype=torch.float64)
        xc = x - x.mean()
        slope = float((xc * (y - y.mean())).sum() / (xc * xc).sum().clamp_min(1e-300))
    return FeatureSweep(points, [int(s) for s in seeds], slope)
