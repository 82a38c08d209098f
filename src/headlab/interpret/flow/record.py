"""One forward pass that records what the flow room needs, per layer, for one input (batch 1).

What is recorded for layer ``l`` (``n`` tokens, ``E`` residual width, ``H`` query heads)::

    x        (n, E)      the attention's input (after the pre-norm in pre-norm blocks)
    resid    (n, E)      what the block adds beside the attention's mixing, token by token: the stream
                         entering the block (the pre norm's input, or x without one), plus the
                         parallel MLP's output in parallel blocks                          [residual mode]
    norm_in  (n, E)      the post norm's input: x + Attn(x) + b_O (post-LN) or Attn(x) + b_O
                         (sandwich)                                                        [residual mode]
    pattern  (H, n, n)   the attention weights                                             [maps]
    q, k     (H, n, d)   queries and keys as the scores see them (k repeated per query head) [streaming]
    lse      (H, n)      log-sum-exp of each query's scores (headlab.attention_stats, tiled: O(n) memory) [streaming]

The attention's input comes from a forward pre-hook on ``adapter.attn_modules[l]``, the norms' inputs
and the parallel MLP's output from hooks on the modules the adapter names
(:func:`~headlab.interpret.flow.blocks.layer_norms`); the hooks
live only for the call (removed in a ``finally``). Patterns, q, k and lse come from
:func:`headlab.capture`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from headlab.attention import backends as _backends
from headlab.errors import BackendUnsupportedError, ConfigError, InputError
from headlab.interpret.capture import capture
from headlab.interpret.flow.blocks import BlockNorms, is_causal, layer_norms
from headlab.models.base import ModelAdapter


@dataclass
class LayerRecord:
    x: torch.Tensor
    resid: torch.Tensor | None = None
    norm_in: torch.Tensor | None = None
    norms: BlockNorms | None = None
    pattern: torch.Tensor | None = None
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    lse: torch.Tensor | None = None


@dataclass
class Recording:
    adapter: ModelAdapter
    n: int  # tokens
    causal: bool
    scale: list[float]  # per layer: the softmax scale the scores use
    tokens: list[str] | None
    layers: dict[int, LayerRecord] = field(default_factory=dict)


def resolve(target):
    """(adapter, LoadedModel or None) from a LoadedModel, an adapter or a model."""
    from headlab.models.loader import LoadedModel, adapt

    if isinstance(target, LoadedModel):
        return target.adapter, target
    if isinstance(target, ModelAdapter):
        return target, None
    if isinstance(target, torch.nn.Module):
        return adapt(target), None
    raise ConfigError(f"expected a LoadedModel (headlab.load), a ModelAdapter or a model, got {type(target).__name__}")


def check_layers(adapter: ModelAdapter, layers) -> list[int]:
    L = adapter.n_layers
    if layers is None:
        return list(range(L))
    if isinstance(layers, int):
        layers = [layers]
    out = []
    for i in layers:
        if not isinstance(i, int) or isinstance(i, bool) or not -L <= i < L:
            raise ConfigError(f"layer {i!r} out of range: the model has {L} layers (0..{L - 1}, or -1 for the last)")
        out.append(i % L)
    return sorted(set(out))


def check_backend(backend) -> None:
    """Refuse an approximate backend: norms, rollout and flow are defined on exact softmax maps."""
    if backend in (None, "auto"):
        return
    b = _backends.get(backend)
    if not b.capabilities.exact:
        raise BackendUnsupportedError(
            f"backend {b.name!r} approximates softmax attention, but norms, rollout and flow are defined on the "
            f"exact maps; use backend='auto', 'sdpa', 'tiled' or 'reference'")


def prepare(loaded, adapter, inputs) -> tuple[dict | torch.Tensor, list[str] | None]:
    """Model inputs for one sequence (batch 1, padding cropped) and its token strings when known."""
    if isinstance(inputs, str):
        if loaded is None:
            raise InputError("text inputs need a LoadedModel (headlab.load(...)) to tokenise them; "
                             "pass an input_ids tensor (1, n) for a bare model")
        enc = loaded.encode(inputs)
    elif isinstance(inputs, Mapping):
        enc = dict(inputs)
    elif isinstance(inputs, torch.Tensor):
        enc = {"input_ids": inputs}
    else:
        raise InputError(f"inputs must be one text, a dict of tensors (input_ids, attention_mask) or an input_ids "
                         f"tensor of shape (1, n); got {type(inputs).__name__}")
    ids = enc.get("input_ids")
    if ids is None and enc and all(isinstance(t, torch.Tensor) and t.shape[0] == 1 for t in enc.values()):
        return enc, None  # one image (pixel_values) or other non-text input: the model says its length
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise InputError(f"one sequence at a time: input_ids must have shape (1, n), got {shape}")
    if ids.shape[1] == 0:
        raise InputError("the input has no tokens")
    am = enc.get("attention_mask")
    if am is not None:
        keep = am[0].bool()
        n = int(keep.sum())
        if n == 0 or not bool(keep[:n].all()):
            raise InputError("the attention_mask must be ones followed by (right) padding for one sequence")
        L = am.shape[1]  # crop what runs along the input (not a decoder's own ids)
        enc = {k: (v[:, :n] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == L
                   and not k.startswith("decoder_") else v) for k, v in enc.items()}
    tokens = None
    tok = getattr(loaded, "tokenizer", None) if loaded is not None else None
    if tok is not None:
        tokens = tok.convert_ids_to_tokens(enc["input_ids"][0].tolist())
    if isinstance(inputs, torch.Tensor) or set(enc) == {"input_ids"}:
        return (enc["input_ids"] if getattr(adapter, "own_model", False) else enc), tokens
    return enc, tokens


def _scale(adapter: ModelAdapter, layer: int) -> float:
    s = getattr(adapter.attn_modules[layer], "scaling", None)
    if s is None:
        s = getattr(adapter.attn_modules[layer], "scale", None)
    return float(s) if isinstance(s, (int, float)) else adapter.head_dim ** -0.5


@contextlib.contextmanager
def _hooks(adapter: ModelAdapter, layers: Sequence[int], store: dict, residual: bool):
    handles = []

    def current(layer) -> bool:  # a module shared by several layers (ALBERT) is computing this one
        return getattr(adapter.attn_modules[layer], "_headlab", None) is adapter.states[layer]

    def attn_pre(layer):
        def hook(module, args, kwargs):
            if current(layer):  # the tensor the layer's values are computed from
                store.setdefault(layer, {})["x"] = adapter.value_input(layer, args, kwargs).detach()[0]
        return hook

    def input_of(layer, key):
        def hook(module, args, kwargs):
            if current(layer):
                x = args[0] if args else next(iter(kwargs.values()))
                store.setdefault(layer, {})[key] = x.detach()[0].clone()
        return hook

    def output_of(layer, key):
        def hook(module, args, output):
            if current(layer):
                out = output[0] if isinstance(output, tuple) else output
                store.setdefault(layer, {})[key] = out.detach()[0].clone()  # clone: Falcon adds into it in place
        return hook

    try:
        for l in layers:
            handles.append(adapter.attn_modules[l].register_forward_pre_hook(attn_pre(l), with_kwargs=True))
            if residual:
                bn = layer_norms(adapter, l)
                if bn.pre is not None:
                    handles.append(bn.pre.register_forward_pre_hook(input_of(l, "pre_in"), with_kwargs=True))
                if bn.post is not None:
                    handles.append(bn.post.register_forward_pre_hook(input_of(l, "norm_in"), with_kwargs=True))
                if bn.parallel is not None:
                    handles.append(bn.parallel.register_forward_hook(output_of(l, "parallel_out")))
        yield
    finally:
        for h in handles:
            h.remove()


def record(target, inputs, layers=None, *, maps: bool, residual: bool = False, backend="auto") -> Recording:
    """Run the model once on ``inputs`` and record, per chosen layer, what the module docstring lists.

    ``maps=True`` records the patterns (n x n per head); ``maps=False`` records q, k and lse only.
    """
    adapter, loaded = resolve(target)
    check_backend(backend)
    chosen = check_layers(adapter, layers)
    if not maps and len(adapter.stacks) > 1:
        raise ConfigError(f"the map-free tiles assume one stack; this model has {', '.join(adapter.stacks)} "
                          "(causal and not): compute its norms and rollout with the maps (stream=False, rows=None)")
    if residual:
        for l in chosen:
            layer_norms(adapter, l)  # UnsupportedArchitectureError before running anything
    model_inputs, tokens = prepare(loaded, adapter, inputs)
    kinds = ["pattern"] if maps else ["q", "k", "stats"]
    sites = [adapter.site_name(l, kind) for l in chosen for kind in kinds]
    store: dict = {}
    with _hooks(adapter, chosen, store, residual):
        cache = capture(adapter, model_inputs, sites, backend=backend, stats_kwargs={"stats": ["lse"]})
    if not maps:
        modded = [l for l in chosen if cache.call_args.get(l, {}).get("score_mod") is not None]
        if modded:
            raise BackendUnsupportedError(
                f"layers {modded} modify their scores ({cache.call_args[modded[0]]['score_mod']!r}: soft-capping, "
                "ALiBi), which the map-free norm, rollout and flow tiles do not apply; run them with stream=False")
    n = int(store[chosen[0]]["x"].shape[0])
    rec = Recording(adapter, n, is_causal(adapter), [_scale(adapter, l) for l in range(adapter.n_layers)], tokens)
    G = adapter.n_heads // adapter.n_kv_heads
    for l in chosen:
        got = store[l]
        lr = LayerRecord(x=got["x"])
        if residual:
            lr.norms = layer_norms(adapter, l)
            lr.resid = got["pre_in"] if lr.norms.pre is not None else got["x"]  # the stream entering the block
            if lr.norms.parallel is not None:
                lr.resid = lr.resid + got["parallel_out"]
            lr.norm_in = got.get("norm_in")
        if maps:
            lr.pattern = cache[adapter.site_name(l, "pattern")][0]  # (H, n, n)
        else:
            lr.q = cache[adapter.site_name(l, "q")][0]  # (H, n, d)
            lr.k = cache[adapter.site_name(l, "k")][0].repeat_interleave(G, dim=0)  # (H, n, d)
            lr.lse = cache[adapter.site_name(l, "stats")].lse[0]  # (H, n)
        rec.layers[l] = lr
    return rec


__all__ = ["LayerRecord", "Recording", "check_backend", "check_layers", "prepare", "record", "resolve"]
