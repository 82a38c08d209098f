"""Capture what each attention head computes: :func:`capture` returns an :class:`ActivationCache`.

Sites are named ``blocks.{layer}.attn.{kind}`` (globs allowed: ``"blocks.*.attn.pattern"``):

=========  =====================  ===============================================================
kind       shape                  what
=========  =====================  ===============================================================
q          (B, H, Lq, d)          queries as the scores see them (after rotary embeddings)
k, v       (B, Hkv, Lk, d)        keys, values (query head h reads kv head h // (H // Hkv))
pattern    (B, H, Lq, Lk)         attention weights; equal to Hugging Face's ``output_attentions``
z          (B, H, L, d)           per-head outputs before W^O (before the adapter's gates)
head_out   (B, H, L, E)           per-head contributions ``gates[l, h] * z_h @ W_O[h]`` (bias excluded;
                                  they sum over h to the output projection minus its bias)
stats      (object)               per-head statistics without maps, from ``headlab.attention_stats``
=========  =====================  ===============================================================

Capturing a layer's pattern runs that layer on the reference backend (its map is materialised
anyway); every other site keeps the backend you chose, so ``sites=["blocks.*.attn.stats"]`` with
``backend="tiled"`` never holds an n x n map. With ``grads=True`` the forward runs with autograd
and ``cache.grads[site]`` holds ``d scalar(outputs) / d site``; the pattern, z and head_out are then
on the path from inputs to outputs, so their gradients are exact.

The capture attaches itself to the model only for the call; it is detached in a ``finally``, also
when the forward or the scalar raises.

    >>> import torch, headlab
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, causal=True)).eval()
    >>> ids = torch.randint(0, 50, (1, 7))
    >>> cache = headlab.capture(m, ids, ["blocks.*.attn.pattern", "blocks.1.attn.z"])
    >>> sorted(cache)
    ['blocks.0.attn.pattern', 'blocks.1.attn.pattern', 'blocks.1.attn.z']
    >>> cache["blocks.1.attn.pattern"].shape, cache["blocks.1.attn.z"].shape
    (torch.Size([1, 4, 7, 7]), torch.Size([1, 4, 7, 8]))
    >>> g = headlab.capture(m, ids, ["blocks.0.attn.pattern"], grads=True, scalar=lambda out: out.logits[0, -1, 3])
    >>> g.grads["blocks.0.attn.pattern"].shape
    torch.Size([1, 4, 7, 7])
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from headlab.attention import backends as _backends
from headlab.errors import ConfigError, InputError
from headlab.models.base import SITE_KINDS, ModelAdapter, site_name


class ActivationCache(Mapping):
    """Captured activations keyed by site name (a read-only dict), plus ``grads`` and ``outputs``.

    Attributes:
        grads: ``{site: d scalar / d site}`` when captured with ``grads=True`` (stats excluded), else ``{}``;
            also ``grads["gates"]`` ``(n_layers, H)`` when ``adapter.gates.requires_grad``.
        outputs: what the model returned.
        scalar: the value of ``scalar(outputs)`` with ``grads=True``, else None.
        adapter: the model's :class:`~headlab.models.base.ModelAdapter`.
    """

    def __init__(self, data: dict, grads: dict, outputs, scalar, adapter: ModelAdapter) -> None:
        self._data = data
        self.grads = grads
        self.outputs = outputs
        self.scalar = scalar
        self.adapter = adapter

    def __getitem__(self, site: str):
        try:
            return self._data[site]
        except KeyError:
            raise KeyError(f"site {site!r} was not captured; captured: {', '.join(self._data) or 'nothing'}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def layer(self, kind: str) -> list:
        """The captured ``kind`` for every layer, in layer order (a list; missing layers are skipped)."""
        return [self._data[s] for i in range(self.adapter.n_layers) if (s := site_name(i, kind)) in self._data]

    def stack(self, kind: str) -> torch.Tensor:
        """``kind`` of every layer stacked on a new first axis: pattern -> ``(n_layers, B, H, Lq, Lk)``."""
        got = self.layer(kind)
        if len(got) != self.adapter.n_layers:
            raise KeyError(f"{kind!r} was captured for {len(got)} of {self.adapter.n_layers} layers; "
                           f"capture sites=['blocks.*.attn.{kind}'] to stack it")
        return torch.stack(got)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
                           for k, v in list(self._data.items())[:6])
        more = f", ... ({len(self._data)} sites)" if len(self._data) > 6 else ""
        return f"ActivationCache({shapes}{more}{', with grads' if self.grads else ''})"


class _Probe:
    """What :func:`run_attention` and the W^O hooks report to during one capture."""

    def __init__(self, wanted: dict[int, set[str]], grads: bool, stats_kwargs: dict) -> None:
        self.wanted = wanted
        self.grads = grads
        self.stats_kwargs = stats_kwargs
        self.live: dict[str, torch.Tensor] = {}  # tensors in the graph (grads mode)
        self.data: dict[str, object] = {}

    def wants(self, layer: int, kind: str) -> bool:
        return kind in self.wanted.get(layer, ())

    def record(self, layer: int, kind: str, t: torch.Tensor) -> torch.Tensor:
        if self.wants(layer, kind):
            name = site_name(layer, kind)
            if self.grads:
                self.live[name] = t
            self.data[name] = t.detach()
        return t

    def record_stats(self, layer: int, q, k, *, mask, causal, scale) -> None:
        fn = _attention_stats()
        params = inspect.signature(fn).parameters
        kw = {"mask": mask, "causal": causal, "scale": scale, **self.stats_kwargs}
        kw = {k_: v_ for k_, v_ in kw.items() if k_ in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())}
        with torch.no_grad():
            # contiguous: HF hands q/k over as transposed views, which attention_stats may .view()
            self.data[site_name(layer, "stats")] = fn(q.detach().contiguous(), k.detach().contiguous(), **kw)


def _attention_stats() -> Callable:
    try:
        from headlab.attention.stats import attention_stats
    except ModuleNotFoundError as e:
        if e.name != "headlab.attention.stats":
            raise
        raise ConfigError("the 'stats' site needs headlab.attention_stats (headlab/attention/stats.py), "
                          "which this installation does not have; capture 'pattern' instead") from None
    return attention_stats


def _resolve(target) -> tuple[ModelAdapter, object | None]:
    """(adapter, LoadedModel or None) from a LoadedModel, an adapter or a model."""
    from headlab.models.loader import LoadedModel, adapt

    if isinstance(target, LoadedModel):
        return target.adapter, target
    if isinstance(target, ModelAdapter):
        return target, None
    if isinstance(target, nn.Module):
        return adapt(target), None
    raise ConfigError(f"capture needs a model, a LoadedModel (headlab.load) or a ModelAdapter, got {type(target).__name__}")


def _select(adapter: ModelAdapter, sites: str | Sequence[str] | None) -> dict[int, set[str]]:
    all_sites = adapter.hook_sites()
    if sites is None:
        patterns = [f"blocks.*.attn.{k}" for k in SITE_KINDS if k != "stats"]
    elif isinstance(sites, str):
        patterns = [sites]
    else:
        patterns = list(sites)
    chosen: dict[int, set[str]] = {}
    for pat in patterns:
        hits = fnmatch.filter(all_sites, pat)
        if not hits:
            raise ConfigError(f"site {pat!r} matches nothing; sites look like 'blocks.0.attn.pattern' "
                              f"(layers 0..{adapter.n_layers - 1}, kinds {', '.join(SITE_KINDS)}); globs allowed")
        for h in hits:
            _, layer, _, kind = h.split(".")
            chosen.setdefault(int(layer), set()).add(kind)
    return chosen


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

    Returns:
        :class:`ActivationCache`; tensors are detached.
    """
    adapter, loaded = _resolve(model_or_loaded_or_adapter)
    wanted = _select(adapter, sites)
    if grads and scalar is None:
        raise ConfigError("grads=True needs scalar=, a function of the model outputs returning a 0-dim tensor, "
                          "e.g. scalar=lambda out: out.logits[0, -1].max()")
    model_inputs = _prepare_inputs(inputs, loaded)
    if any("stats" in kinds for kinds in wanted.values()):
        _attention_stats()  # fail before running the model
    probe = _Probe(wanted, grads, dict(stats_kwargs or {}))
    chosen = backend or adapter.backend or "auto"
    value = None
    grad_map: dict[str, torch.Tensor] = {}
    with adapter.use_backend(chosen), adapter._probing(probe), torch.set_grad_enabled(grads):
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
    return ActivationCache(probe.data, grad_map, outputs, value, adapter)
