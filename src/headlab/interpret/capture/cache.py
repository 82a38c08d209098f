"""The result of a capture: :class:`ActivationCache`, activations keyed by site name."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from headlab.errors import SiteError
from headlab.models.base import ModelAdapter
from headlab.models.sites import SITE_KINDS


class ActivationCache(Mapping):
    """Captured activations keyed by site name (a read-only dict), plus ``grads`` and ``outputs``.

    Attributes:
        grads: ``{site: d scalar / d site}`` when captured with ``grads=True`` (stats excluded), else ``{}``;
            also ``grads["gates"]`` ``(n_layers, H)`` when ``adapter.gates.requires_grad``.
        outputs: what the model returned.
        scalar: the value of ``scalar(outputs)`` with ``grads=True``, else None.
        adapter: the model's :class:`~headlab.models.base.ModelAdapter`.
        call_args: ``{layer: {"mask", "causal", "scale"}}``, what each layer whose ``stats`` were captured
            passed to its attention (the model's own mask and scale), so a map for one head can be
            recomputed exactly as the model computed it.
        shards: the :class:`~headlab.distributed.placement.Placement` of a tensor-parallel capture made with
            ``gather="none"`` (each rank keeps its own heads; :meth:`heads` says which), else None.
    """

    def __init__(
        self,
        data: dict,
        grads: dict,
        outputs,
        scalar,
        adapter: ModelAdapter,
        call_args: dict | None = None,
        shards=None,
    ) -> None:
        self._data = data
        self.shards = shards
        self.call_args = call_args or {}
        self.grads = grads
        self.outputs = outputs
        self.scalar = scalar
        self.adapter = adapter

    def __getitem__(self, site: str):
        try:
            return self._data[site]
        except KeyError:
            raise SiteError(f"site {site!r} was not captured; captured: {', '.join(self._data) or 'nothing'}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def heads(self, site: str) -> range:
        """Global indices of the heads axis 1 of ``site`` holds (query heads; kv heads for k and v): every head,
        ``range(H)``, unless the capture kept tensor-parallel shards (``gather="none"``), then this rank's. A site
        without a head axis (the residual stream) is a :class:`~headlab.errors.SiteError`."""
        kind = site.rsplit(".", 1)[-1]
        if kind not in SITE_KINDS:
            raise SiteError(
                f"site {site!r} has no head axis ({kind} is (B, L, E), the same on every rank); "
                f"heads are on axis 1 of the kinds {', '.join(SITE_KINDS)}"
            )
        self[site]  # a SiteError when it was not captured
        if self.shards is not None:
            return self.shards.heads_of(kind)
        value = self[site]
        if not isinstance(value, torch.Tensor):  # statistics: any field with a head axis (B, H, ...)
            value = next(t for t in value.as_dict().values() if t.dim() >= 3)
        return range(value.shape[1])

    def layer(self, kind: str) -> list:
        """The captured ``kind`` for every layer, in layer order (a list; missing layers are skipped)."""
        names = (self.adapter.site_name(i, kind) for i in range(self.adapter.n_layers))
        return [self._data[s] for s in names if s in self._data]

    def stack(self, kind: str) -> torch.Tensor:
        """``kind`` of every layer stacked on a new first axis: pattern -> ``(n_layers, B, H, Lq, Lk)``."""
        got = self.layer(kind)
        if len(got) != self.adapter.n_layers:
            raise SiteError(
                f"{kind!r} was captured for {len(got)} of {self.adapter.n_layers} layers; "
                f"capture sites={self.adapter.sites(kind)} to stack it"
            )
        return torch.stack(got)

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{k}: {tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
            for k, v in list(self._data.items())[:6]
        )
        more = f", ... ({len(self._data)} sites)" if len(self._data) > 6 else ""
        return f"ActivationCache({shapes}{more}{', with grads' if self.grads else ''})"
