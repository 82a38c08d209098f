"""What the adapter runs each attention layer with: :class:`LayerControls`, the part of
:class:`~headlab.models.base.ModelAdapter` that sets its layers' states for a block.

Each layer's :class:`~headlab.models.sites.LayerState` holds the backend chosen with
:meth:`LayerControls.use_backend`, the active edits (:meth:`LayerControls.hooks`) and the capture probe
(:meth:`LayerControls.probing`); :func:`~headlab.models.sites.run_attention` reads them. Every block restores
what it changed in a ``finally``. The sites and what each holds are listed in :mod:`headlab.models.sites`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Self

import torch

from headlab.attention import backends as _backends
from headlab.errors import ConfigError
from headlab.models import tensor_parallel as _tp  # a model sharded by tensor parallelism: the edit sees every head
from headlab.models.sites import EDITABLE_KINDS, LayerState, match_sites
from headlab.models.stream_sites import RESID_KINDS, stream_edit_hooks, stream_hooks


class LayerControls:
    """The backend, edits and capture of every attention layer, set for a block (mixed into
    :class:`~headlab.models.base.ModelAdapter`, which builds the states)."""

    states: list[LayerState]  # one per attention layer (ModelAdapter.__init__)
    n_layers: int
    site_prefixes: list[str]

    # -- backends ---------------------------------------------------------------------------------------
    @property
    def backend(self) -> str | _backends.Backend | None:
        """The backend set by the innermost :meth:`use_backend`, or None outside one."""
        return self.states[0].backend if self.states else None

    @contextlib.contextmanager
    def use_backend(self, backend: str | _backends.Backend) -> Iterator[Self]:
        """Inside the block every attention layer runs on ``backend`` (a registered name or a Backend).

        >>> import torch
        >>> from headlab.models import adapt
        >>> from headlab.models.transformer import Transformer, TransformerConfig
        >>> m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4)).eval()
        >>> ids = torch.randint(0, 50, (1, 9))
        >>> with adapt(m).use_backend("reference"):
        ...     a = m(ids).logits
        >>> with adapt(m).use_backend("sdpa"):
        ...     b = m(ids).logits
        >>> torch.allclose(a, b, atol=1e-5)
        True
        """
        if not (isinstance(backend, str) and backend == "auto"):
            _backends.get(backend)  # UnknownBackendError naming the known ones
        saved = [st.backend for st in self.states]
        token = self._enter_backend()
        try:
            for st in self.states:
                st.backend = backend
            yield self
        finally:
            for st, b in zip(self.states, saved):
                st.backend = b
            self._exit_backend(token)

    def _enter_backend(self):
        """Route the model's attention through :func:`run_attention` (HF families switch the implementation)."""
        return None

    def _exit_backend(self, token) -> None:
        """Undo :meth:`_enter_backend`."""

    # -- capture and edits ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def hooks(self, edits: Mapping[str, Callable[[torch.Tensor, str], torch.Tensor]]) -> Iterator[Self]:
        """Inside the block, ``fn(tensor, site) -> tensor`` replaces the activation at each site (globs allowed).

        Sites and their shapes are listed in :mod:`headlab.models.sites`; ``stats`` is record-only. An
        edit of ``z`` or ``head_out`` works on every backend; an edit of ``pattern`` runs that layer from
        the edited map on the reference path. An edit must return the shape it was given (else
        :class:`~headlab.errors.ShapeError` naming the site and both shapes). Hooks are removed in a
        ``finally``; nested blocks apply their edits in the order they were entered.

            >>> import torch
            >>> from headlab.models import adapt
            >>> from headlab.models.transformer import Transformer, TransformerConfig
            >>> m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4)).eval()
            >>> ids = torch.randint(0, 50, (1, 9))
            >>> def drop_head_1(z, site):
            ...     z = z.clone(); z[:, 1] = 0; return z
            >>> with adapt(m).hooks({"blocks.0.attn.z": drop_head_1}):
            ...     edited = m(ids).logits
            >>> adapt(m).gates[0, 1] = 0.0
            >>> torch.allclose(edited, m(ids).logits, atol=1e-6)
            True
        """
        if not isinstance(edits, Mapping):
            raise ConfigError(f"hooks takes a mapping {{site: fn(tensor, site) -> tensor}}, got {type(edits).__name__}")
        for site, fn in edits.items():
            if not callable(fn):
                raise ConfigError(
                    f"the edit for {site!r} is {type(fn).__name__}, not a function fn(tensor, site) -> tensor"
                )
        chosen = match_sites(list(edits), self.n_layers, EDITABLE_KINDS + RESID_KINDS, self.site_prefixes)
        stream = {
            layer: set(kinds) & set(RESID_KINDS) for layer, kinds in chosen.items() if set(kinds) & set(RESID_KINDS)
        }
        added: list[tuple[LayerState, str, Callable]] = []
        token = self._enter_backend() if self.backend is None else None
        try:
            for layer, kinds in chosen.items():
                state: LayerState = self.states[layer]
                for kind, patterns in kinds.items():
                    for pat in patterns:
                        fn = _tp.global_edit(self, edits[pat], kind)  # sharded: the edit sees every head
                        state.edits.setdefault(kind, []).append(fn)
                        added.append((state, kind, fn))
            with stream_edit_hooks(self, stream):  # resid_pre, resid_post, mlp_out: hooks on blocks and MLPs
                yield self
        finally:
            for state, kind, fn in reversed(added):
                state.edits[kind].remove(fn)
                if not state.edits[kind]:
                    del state.edits[kind]
            if token is not None:
                self._exit_backend(token)

    @contextlib.contextmanager
    def probing(self, probe) -> Iterator[None]:
        """Attach a capture probe (:mod:`headlab.interpret.capture`) to every layer for the block (always detached)."""
        try:
            for st in self.states:
                st.probe = probe
            with stream_hooks(self, probe):  # the residual-stream sites it asks for (input, resid_pre, ...)
                yield
        finally:
            for st in self.states:
                st.probe = None
                st.z_gated = None
