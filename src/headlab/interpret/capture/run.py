"""Run a model once, recording (and optionally editing) activations: :func:`capture`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from headlab.attention import backends as _backends
from headlab.errors import ConfigError, InputError
from headlab.interpret.capture.cache import ActivationCache
from headlab.interpret.capture.probe import Probe
from headlab.models.base import ModelAdapter
from headlab.models.loader import resolve
from headlab.models.sites import SITE_KINDS, match_sites
from headlab.models.stream_sites import STREAM_KINDS


def _select(adapter: ModelAdapter, sites: str | Sequence[str] | None) -> dict[int, set[str]]:
    if sites is None:
        patterns = [g for k in SITE_KINDS if k != "stats" for g in adapter.sites(k)]
    else:
        patterns = [sites] if isinstance(sites, str) else list(sites)
    return {layer: set(kinds) for layer, kinds in match_sites(patterns, adapter.n_layers, SITE_KINDS + STREAM_KINDS,
                                                              prefixes=adapter.site_prefixes).items()}


def _prepare_inputs(inputs, loaded) -> dict | torch.Tensor:
    if isinstance(inputs, (str, list, tuple)) and (isinstance(inputs, str) or all(isinstance(t, str) for t in inputs)):
        if loaded is None:
            raise InputError("text inputs need a LoadedModel (headlab.load(...)) to tokenise them; "
                             "pass token ids or a dict of tensors for a bare model")
        return loaded.encode(inputs)
    if isinstance(inputs, Mapping):  # a dict, or a tokenizer's BatchEncoding
        return dict(inputs)
    if isinstance(inputs, torch.Tensor):
        return inputs
    raise InputError(f"inputs must be text, a dict of tensors (input_ids, attention_mask) or an input_ids tensor; "
                     f"got {type(inputs).__name__}")


def capture(
    model_or_loaded_or_adapter,
    inputs,
    sites: str | Sequence[str] | None = None,
    *,
    grads: bool = False,
    scalar: Callable | None = None,
    backend: str | _backends.Backend | None = None,
    stats_kwargs: dict | None = None,
    edits: Mapping[str, Callable] | None = None,
) -> ActivationCache:
    """Run the model once and return the activations at ``sites``.

    Args:
        model_or_loaded_or_adapter: an ``nn.Module`` of a supported family, a
            :class:`~headlab.models.loader.LoadedModel`, or a :class:`~headlab.models.base.ModelAdapter`.
        inputs: text or a list of texts (with a LoadedModel), a dict of tensors passed as keyword
            arguments (``input_ids (B, L)``, ``attention_mask (B, L)``), or an ``input_ids`` tensor.
        sites: site names or globs (see the module docstring); default: every site except ``stats``.
        grads: also compute ``d scalar(outputs) / d site`` for every captured site (in ``cache.grads``).
        scalar: ``outputs -> 0-dim tensor``; required with ``grads=True``.
        backend: the headlab backend every attention layer runs on during the capture; default: the
            one set by an enclosing ``adapter.use_backend``, else ``"auto"``.
        stats_kwargs: extra keyword arguments for ``headlab.attention_stats`` (the ``stats`` site).
        edits: ``{site: fn(tensor, site) -> tensor}`` applied during the run, as in
            :meth:`~headlab.models.base.ModelAdapter.hooks`; the cache then holds the edited activations.

    Returns:
        :class:`ActivationCache`; tensors are detached. On a model sharded by tensor parallelism (under torchrun,
        every rank calling ``capture`` alike) the sites hold every head in global order, on every rank.
    """
    adapter, loaded = resolve(model_or_loaded_or_adapter)
    wanted = _select(adapter, sites)
    if grads and scalar is None:
        raise ConfigError("grads=True needs scalar=, a function of the model outputs returning a 0-dim tensor, "
                          "e.g. scalar=lambda out: out.logits[0, -1].max()")
    if grads and adapter.tp is not None:
        raise ConfigError("grads=True is not available yet on a model sharded by tensor parallelism; capture without "
                          "grads, or load the model in one process")
    model_inputs = _prepare_inputs(inputs, loaded)
    probe = Probe(wanted, grads, dict(stats_kwargs or {}), adapter.site_name)
    chosen = backend or adapter.backend or "auto"
    value = None
    grad_map: dict[str, torch.Tensor] = {}
    with adapter.use_backend(chosen), adapter.hooks(edits or {}), adapter.probing(probe), torch.set_grad_enabled(grads):
        outputs = adapter.forward(model_inputs)
        if grads:
            value = scalar(outputs)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ConfigError(f"scalar(outputs) must return a one-element tensor, got "
                                  f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
            if adapter.gates.requires_grad:
                probe.live["gates"] = adapter.gates  # head importance: d scalar / d gates (n_layers, H)
            names = list(probe.live)
            got = torch.autograd.grad(value.reshape(()), [probe.live[n] for n in names], allow_unused=True)
            grad_map = {n: (torch.zeros_like(probe.live[n]) if g is None else g.detach()) for n, g in zip(names, got)}
            value = value.detach()
    data = probe.data
    if adapter.tp is not None:  # tensor parallelism: each rank holds its heads; every rank gets all, in global order
        data = adapter.tp.gather_sites(data)
    return ActivationCache(data, grad_map, outputs, value, adapter, probe.call_args)
