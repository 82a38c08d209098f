"""Hybrid stacks: block lists in which some blocks compute no attention (SSM, convolution, linear-recurrent or
MLP-only blocks between attention blocks: Jamba, Bamba, LFM2, Qwen3-Next, Nemotron-H, ...).

headlab's layers are the attention blocks. A block without attention is part of the model's stack with no
heads: it has no sites, gates or weights in headlab's view, and every analysis runs over the attention blocks.
Layer ``i`` of the adapter is block ``model_blocks[i]`` of the model's block list, and its sites are named by
the model's block index (``blocks.3.attn.pattern`` is the attention of the model's block 3, whatever its
position among the attention blocks); gates, importance and pruning are indexed by the adapter's layers, as
in every model.

What the other blocks do to the attention analyses is measured, not assumed (:func:`token_mixers`): a block
mixes tokens when its output at one position changes with its input at another, its own attention (if any)
held fixed. Residual-mode norms decompose each attention block's own sublayer ``x + Attn(x)``, which the other
blocks do not enter; rollout and attention flow chain the attention maps as the only way tokens mix, so they
are refused (:class:`~headlab.errors.UnsupportedArchitectureError`, :func:`chain_refusal`) when a block mixes
tokens beside or between the attention blocks. Blocks that act on each token alone (MLP-only blocks) are what
rollout already leaves out, and are served.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headlab.models.hf.trace import close, trace
from headlab.models.projections import get_module


def _hidden(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, bool]:
    """A block's stream input: ``(tensor, positional)``."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], True
    t = kwargs.get("hidden_states")
    return (t, False) if isinstance(t, torch.Tensor) else (None, False)


def _first(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def token_mixers(model: nn.Module, x: dict, blocks: list[nn.Module], attention: dict[int, nn.Module]) -> dict[int, str]:
    """The blocks (index in ``blocks``: class name) whose output at one position depends on their input at another
    with their attention module (``attention[i]``, if any) held fixed.

    One forward on the batch doubled: sequence 1 of every block's input is set to sequence 0's with position 0
    moved, sequence 1 of every attention module's output to sequence 0's, and a block mixes tokens when its
    outputs at positions 1.. then differ between the two sequences. Blocks that did not run are named too."""
    x2 = {
        k: torch.cat([v, v]) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 1 else v for k, v in x.items()
    }
    g = torch.Generator().manual_seed(0)
    outs: dict[int, torch.Tensor] = {}
    handles = []

    def pre(i):
        def hook(m, args, kwargs):
            h, positional = _hidden(args, kwargs)
            if h is None or h.dim() != 3 or h.shape[0] != 2:
                return None
            h = torch.stack([h[0], h[0]]).clone()
            h[1, 0] += h[0, 0].abs().mean().clamp_min(1e-3) * torch.randn(h.shape[-1], generator=g).to(h)
            if positional:
                return (h, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": h}

        return hook

    def post(i):
        def hook(m, args, kwargs, out):
            t = _first(out)
            if t is not None:
                outs[i] = t.detach()

        return hook

    def hold(m, args, out):
        t = _first(out)
        if t is None or t.dim() < 1 or t.shape[0] != 2:
            return None
        held = torch.stack([t[0], t[0]])
        return held if isinstance(out, torch.Tensor) else (held, *out[1:])

    for i, b in enumerate(blocks):
        handles.append(b.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(b.register_forward_hook(post(i), with_kwargs=True))
    for am in attention.values():
        handles.append(am.register_forward_hook(hold))
    try:
        trace(model, x2)
    finally:
        for h in handles:
            h.remove()
    mixing: dict[int, str] = {}
    for i, b in enumerate(blocks):
        o = outs.get(i)
        if o is None or o.dim() != 3 or o.shape[0] != 2:
            mixing[i] = f"{type(b).__name__} (did not run as a block of the stream)"
        elif o.shape[1] > 1 and not close(o[1, 1:], o[0, 1:], 1e-6):
            mixing[i] = type(b).__name__
    return mixing


def describe(mixing: dict[int, str], attention: list[int]) -> str:
    """``"blocks 0, 2 (JambaMambaDecoderLayer) mix tokens without an attention map"``-style text."""
    between = sorted(i for i in mixing if i not in attention)
    beside = sorted(i for i in mixing if i in attention)
    names = sorted(set(mixing.values()))
    parts = []
    if between:
        parts.append(f"block{'s' if len(between) > 1 else ''} {', '.join(map(str, between))} (no attention)")
    if beside:
        parts.append(f"block{'s' if len(beside) > 1 else ''} {', '.join(map(str, beside))} (beside their attention)")
    return f"{' and '.join(parts)} mix tokens without an attention map ({', '.join(names)})"


def chain_refusal(found) -> str:
    """Why maps cannot be chained through the model :func:`~headlab.models.hf.structure.discover` found
    (rollout, attention flow), or ``""``."""
    if not found.token_mixers:
        return ""
    return (
        f"rollout and attention flow chain the attention maps of the {found.model_type!r} model as the only way its "
        f"tokens mix, but its {describe(found.token_mixers, found.model_blocks)}: chained without them the result "
        "would not be the model's (attention- and residual-mode norms, captures and every per-layer analysis are "
        "served)"
    )


def hybrid_attrs(found) -> dict[str, Any]:
    """What the adapter class of a found single stack declares for its blocks without attention: ``model_blocks``
    (the model's block index of each layer), the attention blocks as its blocks, sites named by the model's block
    index, and ``chain_refusal`` (read by rollout and attention flow)."""
    attrs: dict[str, Any] = {"chain_refusal": chain_refusal(found), "model_blocks": list(found.model_blocks)}
    if not found.n_blocks > len(found.model_blocks) > 0:  # every block attends
        return attrs
    index = list(found.model_blocks)

    def _blocks(self, model):
        blocks = get_module(model.base_model, self.layers)
        return [blocks[i] for i in index]

    def _site_prefixes(self):
        return [f"blocks.{i}.attn" for i in index]

    attrs.update(_blocks=_blocks, _site_prefixes=_site_prefixes)
    return attrs


__all__ = ["chain_refusal", "describe", "hybrid_attrs", "token_mixers"]
