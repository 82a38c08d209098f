"""The result of :func:`~headlab.attention.stats.attention_stats` and the checks of its arguments."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Literal

import torch

from headlab.errors import BackendUnsupportedError, ConfigError, DTypeError, ShapeError

__all__ = ["STATS", "SDPA_STATS", "AttentionStats"]

Method = Literal["tiled", "sdpa"]

# Every statistic, in the order AttentionStats lists them.
STATS = ("lse", "entropy", "max_weight", "argmax", "mean_distance", "key_mass", "received", "rows")
# What method="sdpa" can deliver through the fused kernel (plus key_mass / rows, computed directly).
SDPA_STATS = ("lse", "entropy", "mean_distance", "key_mass", "received", "rows")


@dataclass(frozen=True)
class AttentionStats:
    """Statistics of one attention call. Fields not asked for are ``None``.

    Shapes (B batch, H query heads, Lq queries, Lk keys); floating fields have the compute dtype
    (float32, or float64 for float64 inputs):

    * ``lse``, ``entropy``, ``max_weight``, ``mean_distance``: ``(B, H, Lq)``; ``argmax``:
      ``(B, H, Lq)`` int64 key index (``-1`` for a fully masked row),
    * ``key_mass``: ``(B, H, Lq, M)``, M = number of ``key_positions``,
    * ``received``: ``(B, H, Lk)``,
    * ``rows``: ``(B, H, R, Lk)``, R = number of ``query_rows``,
    * ``output``: ``(B, H, Lq, Dv)`` attention output (only when ``v`` was given),
    * ``key_positions``: the positions used, ``(M,)`` or ``(B, M)`` int64; ``query_rows``: ``(R,)``,
    * ``visible``: ``(B, H, Lq)`` bool, False for fully masked query rows,
    * ``method``: ``"tiled"`` or ``"sdpa"``.
    """

    lse: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    max_weight: torch.Tensor | None = None
    argmax: torch.Tensor | None = None
    mean_distance: torch.Tensor | None = None
    key_mass: torch.Tensor | None = None
    received: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    output: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None
    query_rows: torch.Tensor | None = None
    visible: torch.Tensor | None = None
    method: str = "tiled"

    def computed(self) -> list[str]:
        """Names of the statistics present (a subset of :data:`STATS`)."""
        return [name for name in STATS if getattr(self, name) is not None]

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The tensors present, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def nbytes(self) -> int:
        """Bytes held by the tensors (what keeping these statistics costs)."""
        return sum(t.numel() * t.element_size() for t in self.as_dict().values())

    def head_means(self) -> dict[str, torch.Tensor]:
        """Per-head means ``(B, H)`` of the per-query statistics over the visible query rows."""
        assert self.visible is not None  # every method fills it
        vis = self.visible.to(self.lse.dtype if self.lse is not None else torch.float32)
        count = vis.sum(-1).clamp_min(1)
        out = {}
        for name in ("lse", "entropy", "max_weight", "mean_distance"):
            t = getattr(self, name)
            if t is not None:
                out[name] = torch.where(self.visible, t, torch.zeros((), dtype=t.dtype)).sum(-1) / count
        return out


# -- argument checks ----------------------------------------------------------------------------


def wanted_stats(stats, method: str, key_positions, query_rows) -> set[str]:
    supported = STATS if method == "tiled" else SDPA_STATS
    if stats is None:
        want = set(supported)
        if key_positions is None:
            want.discard("key_mass")
        if query_rows is None:
            want.discard("rows")
        return want
    if isinstance(stats, str):
        stats = [stats]
    want = set()
    for name in stats:
        if name not in STATS:
            raise ConfigError(f"unknown statistic {name!r}; choose among {', '.join(STATS)}")
        if name not in supported:
            raise BackendUnsupportedError(
                f"method={method!r} cannot compute {name!r} (no identity lets the fused kernel deliver it); "
                f"it supports {', '.join(supported)}; use method='tiled' for {name!r}"
            )
        want.add(name)
    if "key_mass" in want and key_positions is None:
        raise ConfigError("statistic 'key_mass' needs key_positions, e.g. key_positions=[0] for the first token")
    if "rows" in want and query_rows is None:
        raise ConfigError("statistic 'rows' needs query_rows, e.g. query_rows=[0, 5] for queries 0 and 5")
    return want


def index_tensor(name: str, value, length: int, batch: int, *, per_batch_ok: bool) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value
    else:
        try:
            t = torch.as_tensor(list(value) if isinstance(value, Iterable) else [value])
        except (TypeError, ValueError, RuntimeError):
            raise ConfigError(f"{name} must be integer positions, got {value!r}") from None
    if t.numel() == 0:
        raise ConfigError(f"{name} is empty; give at least one position")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise DTypeError(f"{name} must hold integer positions, got dtype {t.dtype}")
    t = t.to(torch.long)
    allowed = "(n,) or (batch, n)" if per_batch_ok else "(n,)"
    if t.dim() == 2 and per_batch_ok:
        if t.shape[0] != batch:
            raise ShapeError(f"{name} given per batch element must have shape (batch={batch}, n), got {tuple(t.shape)}")
    elif t.dim() != 1:
        raise ShapeError(f"{name} must have shape {allowed}, got {tuple(t.shape)}")
    if bool(((t < 0) | (t >= length)).any()):
        raise ConfigError(f"{name} must lie in [0, {length}), got {t.tolist()}")
    return t
