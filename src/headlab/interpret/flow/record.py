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

Everything comes from one :func:`headlab.capture`: the attention's input, the stream entering the
block, the post norm's input and the parallel MLP's output are its record-only sites ``input``,
``resid_pre``, ``norm_in`` and ``parallel_out`` (:mod:`headlab.models.stream_sites`), the patterns,
q, k and lse its attention sites. :func:`from_cache` builds a recording from a capture made for
more (``headlab analyze`` records once for its table, norms and rollout).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

import headlab.checks as checks
from headlab.attention import backends as _backends
from headlab.errors import BackendUnsupportedError, ConfigError, InputError
from headlab.interpret.capture import capture
from headlab.interpret.flow.block_norms import BlockNorms, is_causal, layer_norms
from headlab.models.base import ModelAdapter
from headlab.models.loader import resolve


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


def check_layers(adapter: ModelAdapter, layers) -> list[int]:
    L = adapter.n_layers
    if layers is None:
        return list(range(L))
    if isinstance(layers, int):
        layers = [layers]
    return sorted(
        {
            checks.index(
                "layer",
                i,
                L,
                message="layer {value!r} out of range: the model has {length} layers (0..{high}, or -1 for the last)",
            )
            for i in layers
        }
    )


def check_backend(backend) -> None:
    """Refuse an approximate backend: norms, rollout and flow are defined on exact softmax maps."""
    if not _backends.is_exact(backend):
        raise BackendUnsupportedError(
            f"backend {_backends.get(backend).name!r} approximates softmax attention, but norms, rollout and flow "
            f"are defined on the exact maps; use backend='auto' or one of {', '.join(map(repr, _backends.exact_names()))}"
        )


def prepare(loaded, adapter, inputs) -> tuple[dict | torch.Tensor, list[str] | None]:
    """Model inputs for one sequence (batch 1, padding cropped) and its token strings when known."""
    if isinstance(inputs, str):
        if loaded is None:
            raise InputError(
                "text inputs need a LoadedModel (headlab.load(...)) to tokenise them; "
                "pass an input_ids tensor (1, n) for a bare model"
            )
        enc = loaded.encode(inputs)
    elif isinstance(inputs, Mapping):
        enc = dict(inputs)
    elif isinstance(inputs, torch.Tensor):
        enc = {"input_ids": inputs}
    else:
        raise InputError(
            f"inputs must be one text, a dict of tensors (input_ids, attention_mask) or an input_ids "
            f"tensor of shape (1, n); got {type(inputs).__name__}"
        )
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
        enc = {
            k: (
                v[:, :n]
                if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == L and not k.startswith("decoder_")
                else v
            )
            for k, v in enc.items()
        }
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
    return float(s) if isinstance(s, (int, float)) else adapter.head_dim**-0.5


def sites_for(adapter: ModelAdapter, layers: Sequence[int], *, maps: bool | None, residual: bool = False) -> list[str]:
    """The capture sites a :class:`Recording` of ``layers`` needs (see the module docstring); ``maps=None``:
    the attention inputs only (what the value norms read)."""
    kinds = ["input"] + ([] if maps is None else ["pattern"] if maps else ["q", "k", "stats"])
    if residual:
        kinds += ["resid_pre", "norm_in", "parallel_out"]
    return [adapter.site_name(l, kind) for l in layers for kind in kinds]


def from_cache(
    adapter: ModelAdapter,
    cache,
    layers: Sequence[int],
    *,
    maps: bool | None,
    residual: bool = False,
    tokens: list[str] | None = None,
) -> Recording:
    """A :class:`Recording` of ``layers`` out of a capture that asked for (at least) :func:`sites_for`'s sites,
    so one run of the model can feed the table, the norms and the rollout (``headlab analyze``)."""
    if maps is False:
        modded = [l for l in layers if cache.call_args.get(l, {}).get("score_mod") is not None]
        if modded:
            raise BackendUnsupportedError(
                f"layers {modded} modify their scores ({cache.call_args[modded[0]]['score_mod']!r}: soft-capping, "
                "ALiBi), which the map-free norm, rollout and flow tiles do not apply; run them with stream=False"
            )
    name = adapter.site_name
    n = int(cache[name(layers[0], "input")].shape[1])
    rec = Recording(adapter, n, is_causal(adapter), [_scale(adapter, l) for l in range(adapter.n_layers)], tokens)
    G = adapter.n_heads // adapter.n_kv_heads
    for l in layers:
        lr = LayerRecord(x=cache[name(l, "input")][0])
        if residual:
            lr.norms = layer_norms(adapter, l)
            # the stream entering the block, plus the parallel MLP's output beside the attention's
            lr.resid = cache[name(l, "resid_pre")][0]
            if lr.norms.parallel is not None:
                lr.resid = lr.resid + cache[name(l, "parallel_out")][0]
            lr.norm_in = cache[name(l, "norm_in")][0] if name(l, "norm_in") in cache else None
        if maps:
            lr.pattern = cache[name(l, "pattern")][0]  # (H, n, n)
        elif maps is False:
            lr.q = cache[name(l, "q")][0]  # (H, n, d)
            lr.k = cache[name(l, "k")][0].repeat_interleave(G, dim=0)  # (H, n, d)
            lr.lse = cache[name(l, "stats")].lse[0]  # (H, n)
        rec.layers[l] = lr
    return rec


def record(target, inputs, layers=None, *, maps: bool | None, residual: bool = False, backend="auto") -> Recording:
    """Run the model once on ``inputs`` (one :func:`headlab.capture`) and record, per chosen layer, what the
    module docstring lists. ``maps=True`` records the patterns (n x n per head); ``maps=False`` records q, k
    and lse; ``maps=None`` neither (the attention inputs, and the residual stream with ``residual``). A :class:`Recording` passed as ``inputs`` is returned as it is, once checked to hold
    ``layers`` in the form asked for: the analyses that take inputs take a recording, so one run feeds them all.
    """
    adapter, loaded = resolve(target)
    if isinstance(inputs, Recording):
        return _reuse(inputs, adapter, check_layers(adapter, layers), maps=maps, residual=residual)
    check_backend(backend)
    chosen = check_layers(adapter, layers)
    if maps is False and len(adapter.stacks) > 1:
        raise ConfigError(
            f"the map-free tiles assume one stack; this model has {', '.join(adapter.stacks)} "
            "(causal and not): compute its norms and rollout with the maps (stream=False, rows=None)"
        )
    if residual:
        for l in chosen:
            layer_norms(adapter, l)  # UnsupportedArchitectureError before running anything
    model_inputs, tokens = prepare(loaded, adapter, inputs)
    cache = capture(
        adapter,
        model_inputs,
        sites_for(adapter, chosen, maps=maps, residual=residual),
        backend=backend,
        stats_kwargs={"stats": ["lse"]},
    )
    return from_cache(adapter, cache, chosen, maps=maps, residual=residual, tokens=tokens)


def _reuse(rec: Recording, adapter: ModelAdapter, layers: list[int], *, maps: bool | None, residual: bool) -> Recording:
    if rec.adapter is not adapter:
        raise ConfigError("this recording was made on another model; record it on the model you analyse")
    missing = [l for l in layers if l not in rec.layers]
    form = "x" if maps is None else "pattern" if maps else "lse"
    lacking = [l for l in layers if l in rec.layers and getattr(rec.layers[l], form) is None]
    if missing or lacking or (residual and any(rec.layers[l].resid is None for l in layers)):
        raise ConfigError(
            f"the recording lacks what this analysis needs (layers {missing or lacking or layers}: "
            f"{'inputs' if maps is None else 'maps' if maps else 'q, k and lse'}"
            f"{', residual' if residual else ''}); "
            "record those layers with flow.record.record(..., maps=..., residual=...)"
        )
    sub = Recording(rec.adapter, rec.n, rec.causal, rec.scale, rec.tokens)
    sub.layers = {l: rec.layers[l] for l in layers}
    return sub


__all__ = ["LayerRecord", "Recording", "check_backend", "check_layers", "from_cache", "prepare", "record", "sites_for"]
