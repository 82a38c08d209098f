"""The result of a capture: :class:`ActivationCache`, activations keyed by site name."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from headlab.errors import SiteError
from headlab.models.base import ModelAdapter


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
    """

    def __init__(self, data: dict, grads: dict, outputs, scalar, adapter: ModelAdapter,
                 call_args: dict | None = None) -> None:
        self._data = data
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

    def layer(self, kind: str) -> list:
        """The captured ``kind`` for every layer, in layer order (a list; missing layers are skipped)."""
        names = (self.adapter.site_name(i, kind) for i in range(self.adapter.n_layers))
        return [self._data[s] for s in names if s in self._data]

    def stack(self, kind: str) -> torch.Tensor:
        """``kind`` of every layer stacked on a new first axis: pattern -> ``(n_layers, B, H, Lq, Lk)``."""
        got = self.layer(kind)
        if len(got) != self.adapter.n_layers:
            raise SiteError(f"{kind!r} was captured for {len(got)} of {self.adapter.n_layers} layers; "
                           f"capture sites={self.adapter.sites(kind)} to stack it")
        return torch.stack(got)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
                           for k, v in list(self._data.items())[:6])
        more = f", ... ({len(self._data)} sites)" if len(self._data) > 6 else ""
        return f"ActivationCache({shapes}{more}{', with grads' if self.grads else ''})"
