"""Hook sites: where every attention layer of an adapted model can be recorded and edited.

Sites are named by where they sit: ``blocks.{layer}.attn.{kind}`` in a model with one stack of
self-attention layers; in an encoder-decoder, ``encoder.{l}.attn.{kind}`` (encoder self-attention),
``decoder.{l}.attn.{kind}`` (decoder self-attention) and ``decoder.{l}.cross.{kind}`` (the decoder's
attention over the encoder's output). Internally every attention layer has one index (the adapter's
``site_prefixes[i]`` names it); gates, importance and pruning are indexed the same way.

=========  =====================  ===================================================================
kind       shape                  what, exactly as computed
=========  =====================  ===================================================================
q          (B, H, Lq, d)          queries as the scores see them (after any rotary embedding)
k, v       (B, Hkv, Lk, d)        keys, values (query head h reads kv head ``h // (H // Hkv)``)
pattern    (B, H, Lq, Lk)         attention weights ``softmax(q k^T * scale + mask)``
z          (B, H, L, d)           head h's output ``pattern_h @ v_h``, the input of W^O split into
                                  heads, *before* the adapter's gates multiply it
head_out   (B, H, L, E)           head h's share of the output projection ``gates[l, h] * z_h @ W_O[h]``
                                  (bias excluded: the heads sum to W^O's output minus its bias)
stats      (object)               per-head statistics without maps (``headlab.attention_stats``);
                                  recorded only, never edited
=========  =====================  ===================================================================

Every layer carries a :class:`LayerState`. :func:`run_attention` (q, k, v, pattern) and the two hooks
on W^O (z, head_out) pass each tensor through :func:`visit`, which applies the active edits of that
site (``fn(tensor, site) -> tensor``, in the order they were entered) and then records the edited
tensor for an active capture. So a capture shows what the model computed with, edits included.

- Editing ``q``, ``k``, ``v``, ``z`` or ``head_out`` works on every backend, fused ones included.
- Editing ``pattern`` runs that layer on the reference backend: the map is materialised, edited, and
  the layer's output is recomputed from the edited map (``pattern @ v``, dropout not applied).
- An edit of ``head_out`` rebuilds W^O's output as ``sum_h head_out[h] + b_O``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from headlab.attention import backends as _backends
from headlab.attention.core import attention_with_weights
from headlab.errors import ShapeError, SiteError
from headlab.spec.attention_spec import validate

SITE_KINDS = ("q", "k", "v", "pattern", "z", "head_out", "stats")
EDITABLE_KINDS = ("q", "k", "v", "pattern", "z", "head_out")

Edit = Callable[[torch.Tensor, str], torch.Tensor]


def site_name(layer: int, kind: str) -> str:
    """``site_name(3, "pattern") == "blocks.3.attn.pattern"``."""
    return f"blocks.{layer}.attn.{kind}"


def default_prefixes(n_layers: int) -> list[str]:
    """``["blocks.0.attn", "blocks.1.attn", ...]``: the site prefixes of a single-stack model."""
    return [f"blocks.{i}.attn" for i in range(n_layers)]


def match_sites(
    patterns: Iterable[str], n_layers: int, kinds: tuple[str, ...] = SITE_KINDS, prefixes: list[str] | None = None
) -> dict[int, dict[str, list[str]]]:
    """``{layer: {kind: [pattern, ...]}}`` for site names or globs; a pattern matching nothing is a SiteError.

    ``prefixes[i]`` names layer i (default ``blocks.{i}.attn``; an encoder-decoder's adapter passes its own).

        >>> match_sites(["blocks.*.attn.z", "blocks.1.attn.q"], n_layers=2)
        {0: {'z': ['blocks.*.attn.z']}, 1: {'z': ['blocks.*.attn.z'], 'q': ['blocks.1.attn.q']}}
    """
    prefixes = prefixes or default_prefixes(n_layers)
    where = {f"{p}.{k}": (i, k) for i, p in enumerate(prefixes) for k in kinds}
    names = list(where)
    chosen: dict[int, dict[str, list[str]]] = {}
    for pat in patterns:
        if not isinstance(pat, str):
            raise SiteError(f"site names are strings like '{names[0]}', got {type(pat).__name__}")
        hits = fnmatch.filter(names, pat)
        if not hits:
            stacks = sorted({p.split(".")[0] + ".{l}." + p.split(".")[2] for p in prefixes})
            raise SiteError(
                f"site {pat!r} matches nothing; sites look like '{prefixes[0]}.{kinds[0]}' "
                f"({', '.join(s + '.{kind}' for s in stacks)}; {len(prefixes)} attention layers, kinds "
                f"{', '.join(kinds)}); globs allowed"
            )
        for h in hits:
            layer, kind = where[h]
            chosen.setdefault(layer, {}).setdefault(kind, []).append(pat)
    return chosen


@dataclass
class LayerState:
    """What headlab keeps on one attention module and its output projection (as ``module._headlab``)."""

    layer: int  # index of the attention layer (over every stack, in the adapter's order)
    n_heads: int  # query heads, to split the output projection's input into heads
    head_dim: int
    backend: str | _backends.Backend | None = None  # set by use_backend; None = the module's own choice
    probe: Any = None  # an active capture (headlab.interpret.capture), or None
    adapter: Any = None  # the ModelAdapter (its gates and W_O); kept here so a deep copy stays consistent
    edits: dict[str, list[Edit]] = field(default_factory=dict)  # kind -> active edits, applied in order
    z_gated: torch.Tensor | None = None  # (B, H, L, d) stashed between W^O's pre-hook and hook
    site: str = ""  # the layer's site prefix, e.g. "blocks.3.attn" or "decoder.1.cross"

    def __post_init__(self) -> None:
        self.site = self.site or f"blocks.{self.layer}.attn"

    def wants(self, kind: str) -> bool:
        """Is ``kind`` edited, or recorded by an active capture, in this layer?"""
        return bool(self.edits.get(kind)) or (self.probe is not None and self.probe.wants(self.layer, kind))


def state_of(module: nn.Module) -> LayerState | None:
    return getattr(module, "_headlab", None)


def visit(state: LayerState, kind: str, t: torch.Tensor) -> torch.Tensor:
    """Apply the layer's edits of ``kind`` to ``t`` (checking each keeps the shape), then record it."""
    t = apply_edits(state, kind, t)
    if state.probe is not None:
        t = state.probe.record(state.layer, kind, t)
    return t


def apply_edits(state: LayerState, kind: str, t: torch.Tensor) -> torch.Tensor:
    """The layer's edits of ``kind`` applied to ``t`` in order, each checked to keep the shape."""
    site = f"{state.site}.{kind}"
    for fn in state.edits.get(kind, ()):
        new = fn(t, site)
        if not isinstance(new, torch.Tensor):
            raise ShapeError(
                f"the edit of {site} returned {type(new).__name__}; it must return a tensor of shape {tuple(t.shape)}"
            )
        if new.shape != t.shape:
            raise ShapeError(
                f"the edit of {site} returned shape {tuple(new.shape)}; the site has shape "
                f"{tuple(t.shape)}: return a tensor of the same shape"
            )
        t = new.to(t.dtype)
    return t


def _pattern_times_v(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``p (B, H, Lq, Lk) @ v (B, Hkv, Lk, d)`` with query head h reading kv head ``h // (H // Hkv)``."""
    B, H, Lq, Lk = p.shape
    Hkv = v.shape[1]
    out = p.view(B, Hkv, H // Hkv, Lq, Lk) @ v.unsqueeze(2)  # (B, Hkv, G, Lq, d)
    return out.reshape(B, H, Lq, v.shape[-1])


def _stats_may_serve(backend, q, k, v, mask, causal: bool, extra: dict) -> bool:
    """Whether the statistics' exact pass may stand in for this layer's attention call on ``backend``: the
    backend computes exact attention (it says so in its capabilities) and would serve this very call, so a
    layer that refuses without capture refuses with it too. ``"auto"`` picks an exact backend that serves it."""
    if not _backends.is_exact(backend):
        return False
    if isinstance(backend, str) and backend == "auto":
        return True
    spec, _ = validate(q, k, v, mask=mask, causal=causal, score_mod=extra.get("score_mod"))
    return _backends.get(backend).supports(spec)[0]


def run_attention(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    scale: float | None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    score_kwargs: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention for one layer of an adapted model, with edits and capture. Returns ``(out (B, H, Lq, d), weights)``.

    Args:
        module: the attention module (carries the :class:`LayerState`).
        q: ``(B, H, Lq, d)``; k, v: ``(B, Hkv, Lk, d)``.
        mask: boolean, broadcastable to ``(B, H, Lq, Lk)``, True = may attend; or None.
        causal, scale, dropout_p: as in :func:`headlab.attention`.
        need_weights: also return the ``(B, H, Lq, Lk)`` weights (computed by the reference backend).
        score_kwargs: extra keyword arguments for :func:`headlab.attention` (e.g. a ``score_mod``).

    The backend is the one chosen by :meth:`ModelAdapter.use_backend`, else the module's own
    ``backend`` attribute, else ``"auto"``. When the pattern is edited or captured, the layer runs on
    the reference backend (the map is materialised anyway) and its output is computed *from* that
    pattern, so gradients with respect to it are real.
    """
    state = state_of(module)
    backend = (state.backend if state is not None else None) or getattr(module, "backend", None) or "auto"
    extra = dict(score_kwargs or {})
    edit_pattern = False
    if state is not None and (state.probe is not None or state.edits):
        probe = state.probe
        if probe is not None and probe.grads:
            # make every captured site part of the graph even when the weights are frozen
            q, k, v = (t if t.requires_grad else t.detach().requires_grad_(True) for t in (q, k, v))
        q = visit(state, "q", q)  # (B, H, Lq, d)
        k = visit(state, "k", k)  # (B, Hkv, Lk, d)
        v = visit(state, "v", v)  # (B, Hkv, Lk, d)
        edit_pattern = bool(state.edits.get("pattern"))
        need_weights = need_weights or state.wants("pattern")
        if probe is not None and probe.wants(state.layer, "stats"):
            # the statistics' own pass gives the exact output too: no second attention call, unless
            # the layer needs weights, dropout, gradients, or a backend that is not exact attention
            reuse = (
                not need_weights
                and dropout_p == 0
                and not probe.grads
                and not torch.is_grad_enabled()
                and _stats_may_serve(backend, q, k, v, mask, causal, extra)
            )
            st = probe.record_stats(
                state.layer, q, k, v if reuse else None, mask=mask, causal=causal, scale=scale, **extra
            )
            if reuse:
                return st.output.to(v.dtype), None
    if need_weights:
        out, weights = attention_with_weights(
            q,
            k,
            v,
            mask=mask,
            causal=causal,
            scale=scale,
            dropout_p=dropout_p,
            backend="reference",
            need_weights=True,
            **extra,
        )
        if state is not None:
            assert weights is not None  # need_weights
            weights = visit(state, "pattern", weights)  # (B, H, Lq, Lk)
            if edit_pattern:
                out = _pattern_times_v(weights, v)  # (B, H, Lq, d), from the edited map
        return out, weights
    out, _ = attention_with_weights(
        q,
        k,
        v,
        mask=mask,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        backend=backend,
        need_weights=False,
        **extra,
    )
    return out, None


# -- the two hooks on every output projection W^O (module-level: they find everything on the module) ----------
def gate_hook(module: nn.Module, args: tuple):
    """Pre-hook: split W^O's input into heads, edit and report z, multiply by the gates, join again."""
    x = args[0]
    state: LayerState = module._headlab  # type: ignore[assignment]  # torch types module attributes Tensor | Module
    H, d = state.n_heads, state.head_dim
    lead = x.shape[:-1]
    z = x.reshape(*lead, H, d).movedim(-2, -3)  # (B, L, H*d) -> (B, H, L, d)
    z = visit(state, "z", z)
    # a physically pruned layer keeps fewer heads than the widest one: its gates are gates[l, :H]
    g = state.adapter.gates[state.layer, :H].to(device=z.device, dtype=z.dtype).view(H, 1, 1)
    zg = z * g  # (B, H, L, d)
    state.z_gated = zg if state.wants("head_out") else None
    return (zg.movedim(-3, -2).reshape(*lead, H * d), *args[1:])  # (B, L, H*d)


def head_out_hook(module: nn.Module, args: tuple, output: torch.Tensor):
    """Hook: edit and report head_out[h] = gated z_h @ W_O[h] (B, H, L, E); rebuild the output from it when
    it was edited or its gradient is wanted."""
    state: LayerState = module._headlab  # type: ignore[assignment]  # torch types module attributes Tensor | Module
    zg, state.z_gated = state.z_gated, None
    if zg is None:
        return None
    adapter = state.adapter
    head_out = torch.einsum("bhld,hde->bhle", zg, adapter.W_O(state.layer).to(zg.dtype))  # (B, H, L, E)
    head_out = visit(state, "head_out", head_out)
    if state.edits.get("head_out") or (state.probe is not None and state.probe.grads):
        b = adapter.b_O(state.layer)
        new = head_out.sum(-3)  # (B, L, E)
        return new if b is None else new + b
    return None
