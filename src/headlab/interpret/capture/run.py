"""Run a model once, recording (and optionally editing) activations: :func:`capture`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from headlab.attention import backends as _backends
from headlab.errors import ConfigError, InputError, SiteError
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
        given = [sites] if isinstance(sites, str) else list(sites) if isinstance(sites, (list, tuple)) else None
        if given is None or not all(isinstance(p, str) for p in given):  # 5: a TypeError before
            raise SiteError(
                f"sites must be a site name or glob, or a list of them (e.g. 'blocks.*.attn.pattern'), got {sites!r}"
            )
        patterns = given
    return {
        layer: set(kinds)
        for layer, kinds in match_sites(
            patterns, adapter.n_layers, SITE_KINDS + STREAM_KINDS, prefixes=adapter.site_prefixes
        ).items()
    }


def prepare_inputs(inputs, loaded) -> dict | torch.Tensor:
    if isinstance(inputs, (str, list, tuple)) and (isinstance(inputs, str) or all(isinstance(t, str) for t in inputs)):
        if loaded is None:
            raise InputError(
                "text inputs need a LoadedModel (headlab.load(...)) to tokenise them; "
                "pass token ids or a dict of tensors for a bare model"
            )
        return loaded.encode(inputs)
    if isinstance(inputs, Mapping):  # a dict, or a tokenizer's BatchEncoding
        return dict(inputs)
    if isinstance(inputs, torch.Tensor):
        return inputs
    raise InputError(
        f"inputs must be text, a dict of tensors (input_ids, attention_mask) or an input_ids tensor; "
        f"got {type(inputs).__name__}"
    )


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
    gather: Literal["all", "rank0", "none"] | bool = "all",
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
        gather: on a model sharded by tensor parallelism (under torchrun, every rank calling ``capture`` alike),
            where the heads' sites go: ``"all"`` (or True, the default) every rank gets every head in global
            order; ``"rank0"`` rank 0 gets them and every other rank gets an empty cache (no sites; ``outputs``
            kept), for memory; ``"none"`` (or False) each rank keeps its own heads, and ``cache.heads(site)``
            gives their global indices. Sites without a head axis (the residual stream) are the same on every
            rank. Without tensor parallelism every rank has every head and ``gather`` changes nothing.

    Returns:
        :class:`ActivationCache`; tensors are detached.
    """
    adapter, loaded = resolve(model_or_loaded_or_adapter)
    to = {True: "all", False: "none"}.get(gather, gather) if isinstance(gather, bool) else gather
    if to not in ("all", "rank0", "none"):
        raise ConfigError(
            f"gather={gather!r}: give 'all' (every rank gets every head), 'rank0' (only rank 0 does) "
            "or 'none' (each rank keeps its own heads)"
        )
    wanted = _select(adapter, sites)
    if grads and scalar is None:
        raise ConfigError(
            "grads=True needs scalar=, a function of the model outputs returning a 0-dim tensor, "
            "e.g. scalar=lambda out: out.logits[0, -1].max()"
        )
    if grads:  # the stream sites and the statistics are recorded beside the model's graph, not in it
        flat = sorted({k for kinds in wanted.values() for k in kinds if k in STREAM_KINDS or k == "stats"})
        if flat:
            raise ConfigError(
                f"grads=True takes gradients at the sites inside attention (q, k, v, pattern, z, "
                f"head_out, ...), not at {', '.join(flat)}; capture those without grads, or take "
                "gradients at a site inside attention"
            )
    model_inputs = prepare_inputs(inputs, loaded)
    probe = Probe(wanted, grads, dict(stats_kwargs or {}), adapter.site_name)
    chosen = backend or adapter.backend or "auto"
    value = None
    grad_map: dict[str, torch.Tensor] = {}
    with adapter.use_backend(chosen), adapter.hooks(edits or {}), adapter.probing(probe), torch.set_grad_enabled(grads):
        outputs = adapter.forward(model_inputs)
        if grads:
            assert scalar is not None  # checked above
            value = scalar(outputs)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ConfigError(
                    f"scalar(outputs) must return a one-element tensor, got "
                    f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}"
                )
            if adapter.gates.requires_grad:
                probe.live["gates"] = adapter.gates  # head importance: d scalar / d gates (n_layers, H)
            names = list(probe.live)
            got = torch.autograd.grad(value.reshape(()), [probe.live[n] for n in names], allow_unused=True)
            grad_map = {n: (torch.zeros_like(probe.live[n]) if g is None else g.detach()) for n, g in zip(names, got)}
            value = value.detach()
    data, shards = probe.data, None
    place = adapter.placement
    if place.sharded and "gates" in grad_map:  # each rank's gates act on its own heads (zeros elsewhere)
        grad_map["gates"] = place.sum_group(grad_map["gates"])
    if place.sharded and to != "none":  # tensor parallelism: each rank holds its heads; in global order to
        data = place.gather_sites(data, to)  # every rank, or rank 0; their gradients alike (each rank's heads
        grad_map = place.gather_sites(grad_map, to) if grad_map else grad_map  # get theirs whole: tp_grads)
    elif place.sharded:
        shards = place  # kept where they are: cache.heads(site) says which
    return ActivationCache(data, grad_map, outputs, value, adapter, probe.call_args, shards=shards)
