"""The statistics of an ablation (:mod:`headlab.interpret.heads.ablation`): which heads each configuration gates
off, the bootstrap intervals over examples, and the linear CKA of two heads' outputs (from z collected at real
tokens)."""

from __future__ import annotations

import numpy as np
import torch

import headlab.checks as checks
from headlab.errors import ConfigError

MAX_BOOT = 100_000  # bootstrap resamples: a (MAX_BOOT, examples) table of counts, seconds at most


def config_masks(adapter, configs: list[list[tuple[int, int]]]) -> torch.Tensor:
    """``(C, n_layers, H)`` bool, True where configuration ``c`` gates head ``(l, h)`` off."""
    m = torch.zeros(len(configs), adapter.n_layers, adapter.n_heads, dtype=torch.bool)
    for i, cfg in enumerate(configs):
        for l, h in cfg:
            m[i, l, h] = True
    return m


def check_bootstrap(n_boot, alpha) -> None:
    """:class:`~headlab.errors.ConfigError` unless ``n_boot`` is an integer >= 2 and ``0 < alpha < 1``."""
    checks.int_at_least(
        "n_boot (bootstrap resamples; CLI --boot)",
        n_boot,
        2,
        message="{name} must be an integer of at least {low}, got {value!r}; 1000 is the default",
    )
    if n_boot > MAX_BOOT:  # 10**12 resamples loaded the model and then drew (n_boot, examples) counts without end
        raise ConfigError(
            f"n_boot (bootstrap resamples; CLI --boot) must be at most {MAX_BOOT:,}, got {n_boot:,}; "
            "1000 is the default (more resamples barely move a 95% interval)"
        )
    if not 0 < alpha < 1:
        raise ConfigError(f"alpha must lie in (0, 1) (0.05 gives 95% intervals), got {alpha!r}")


def bootstrap(d: np.ndarray, counts: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Mean of each row of ``d (C, N)`` and its percentile interval from resample ``counts (n_boot, N)``;
    with one example no interval can be estimated: NaN."""
    means = d.mean(-1)
    if d.shape[1] < 2:
        return means, np.full((d.shape[0], 2), np.nan)
    boots = d @ counts.T / d.shape[1]  # (C, n_boot)
    lo, hi = np.percentile(boots, [100 * alpha / 2, 100 * (1 - alpha / 2)], axis=1)
    return means, np.stack([lo, hi], -1)


def linear_cka(zx: torch.Tensor, zy: torch.Tensor, wx: torch.Tensor, wy: torch.Tensor) -> float:
    """Linear CKA of ``X = zx @ wx`` and ``Y = zy @ wy`` (``z (N, d)``, ``w (d, E)``), without forming X, Y.

    CKA(X, Y) = |Xc^T Yc|_F^2 / (|Xc^T Xc|_F |Yc^T Yc|_F), Xc = X centred over the N rows; with
    X = Z A: |Xc^T Yc|_F^2 = tr(M^T P_x M P_y), M = Zc_x^T Zc_y (d x d), P = A A^T (d x d)."""
    zx, zy = zx.double() - zx.double().mean(0), zy.double() - zy.double().mean(0)
    px, py = wx.double() @ wx.double().T, wy.double() @ wy.double().T

    def hs(a, pa, b, pb):
        m = a.T @ b
        return torch.trace(m.T @ pa @ m @ pb)

    num = hs(zx, px, zy, py)
    den = torch.sqrt(hs(zx, px, zx, px) * hs(zy, py, zy, py))
    return float(num / den) if float(den) > 0 else float("nan")


def collect_z(store: dict, heads, zs: dict, mask, cap: int) -> None:
    """Append z_h at real tokens ``(n, d)`` for the CKA, up to ``cap`` tokens per head. ``mask``: ``(B, L)`` real
    tokens, or ``mask(layer, length)`` giving them per layer (an encoder-decoder's decoder tokens differ)."""
    for l, h in heads:
        have = store.get((l, h))
        if have is not None and have.shape[0] >= cap:
            continue
        m = mask(l, zs[l].shape[2]) if callable(mask) else mask
        z = zs[l][:, h][m]  # (n, d)
        new = z if have is None else torch.cat([have, z], 0)
        store[(l, h)] = new[:cap]


__all__ = ["MAX_BOOT", "bootstrap", "check_bootstrap", "collect_z", "config_masks", "linear_cka"]
