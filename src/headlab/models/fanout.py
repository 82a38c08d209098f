"""Run the layers below an edit once: :func:`fan_out`, the prefix sharing of batched ablation.

An ablation (or patching) study runs the same examples many times, each time with other heads of
layer ``l`` or above edited. Layers ``0 .. l - 1`` compute the same thing in every run. Inside
``fan_out(adapter, start, copies)`` the model is called on the ``B`` examples once; a pre-hook on
block ``start`` repeats its input ``copies`` times along the batch (``(B, ...) -> (copies * B, ...)``,
copy-major), and on every later block repeats the per-example tensors the model hands each block
(masks, rotary tables, ...), so the model's output has ``copies * B`` rows, exactly as if the
inputs had been repeated before the embedding. By default block ``start``'s attention core (up to
W^O's input) runs once too, and the copies begin there. For a study whose edits start at layer ``l``
of ``n``, the work drops from ``copies * n`` layer passes per example to about ``l + copies * (n - l)``.

The blocks are found from the adapter (the element of the model's layer list that holds each
layer's attention module); :func:`blocks` returns None for a model whose layers are not one
``ModuleList``, and callers then repeat the inputs instead.

    >>> import torch
    >>> from headlab.models import adapt
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=3, n_heads=4)).eval()
    >>> ids = torch.randint(0, 50, (2, 7))
    >>> with fan_out(adapt(m), start=1, copies=3):
    ...     out = m(ids).logits
    >>> out.shape, torch.allclose(out, m(ids.repeat(3, 1)).logits, atol=1e-6)
    (torch.Size([6, 7, 50]), True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from headlab.errors import ConfigError


def blocks(adapter) -> list[nn.Module] | None:
    """The block module of every layer (the model's layer list, in order), or None when the
    model's layers are not the elements of one ``nn.ModuleList`` holding the attention modules."""
    cached = getattr(adapter, "_fanout_blocks", False)
    if cached is not False:
        return cast("list[nn.Module] | None", cached)
    found = None
    attn = adapter.attn_modules
    for module in adapter.model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) == adapter.n_layers
            and all(any(m is a for m in blk.modules()) for blk, a in zip(module, attn))
        ):
            found = list(module)
            break
    adapter._fanout_blocks = found
    return found


def _repeat(x, batch: int, copies: int):
    """Every tensor of ``batch`` rows (inside tuples, lists and dicts too) repeated ``copies`` times."""
    if isinstance(x, torch.Tensor):
        return x.repeat(copies, *([1] * (x.dim() - 1))) if x.dim() and x.shape[0] == batch else x
    if isinstance(x, tuple | list):
        return type(x)(_repeat(v, batch, copies) for v in x)
    if isinstance(x, dict):
        return {k: _repeat(v, batch, copies) for k, v in x.items()}
    return x


def _first(x, batch: int, copies: int):
    """Every tensor of ``copies * batch`` rows cut to its first copy (``batch`` rows)."""
    if isinstance(x, torch.Tensor):
        return x[:batch] if x.dim() and x.shape[0] == batch * copies else x
    if isinstance(x, tuple | list):
        return type(x)(_first(v, batch, copies) for v in x)
    if isinstance(x, dict):
        return {k: _first(v, batch, copies) for k, v in x.items()}
    return x


@contextlib.contextmanager
def fan_out(adapter, start: int, copies: int, *, share_attention: bool = True) -> Iterator[None]:
    """Inside the block, a call on ``B`` examples runs blocks ``< start`` once and the rest on
    ``copies * B`` rows (copy-major: row ``c * B + i`` is copy ``c`` of example ``i``).

    ``share_attention``: block ``start``'s attention core (Q, K, V and the weighted values, up to
    W^O's input ``z``) also runs once per example; the copies start at ``z``, where the edits of
    ``adapter.hooks({"blocks.L.attn.z": ...})`` act. Leave it off when an edit reads an earlier site
    of that layer (``q``, ``k``, ``v``, ``pattern``) per copy.

    Raises :class:`~headlab.errors.ConfigError` when the model's blocks cannot be found (check
    :func:`blocks` first) or ``start`` is not a layer."""
    found = blocks(adapter)
    if found is None:
        raise ConfigError(
            f"fan_out: the blocks of {type(adapter.model).__name__} are not one layer list; repeat the inputs instead"
        )
    if not 0 <= start < len(found):
        raise ConfigError(f"fan_out: start={start} is not a layer (0..{len(found) - 1})")
    if copies == 1:
        yield
        return
    state: dict = {}

    def first(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        state["batch"] = x.shape[0]
        return _repeat(args, x.shape[0], copies), _repeat(kwargs, x.shape[0], copies)

    def later(module, args, kwargs):
        b = state.get("batch")
        if b is None or b * copies == b:
            return None
        x = args[0] if args else kwargs.get("hidden_states")
        if x is not None and x.shape[0] == b:  # not fanned out yet: should not happen below `start`
            return None
        return _repeat(args, b, copies), _repeat(kwargs, b, copies)

    def core_in(module, args, kwargs):  # the attention core of block `start` on the first copy only
        b = state["batch"]
        return _first(args, b, copies), _first(kwargs, b, copies)

    def core_out(module, args):  # ... and W^O's input back to every copy, before the gates and edits
        return _repeat(args, state["batch"], copies)

    handles = [found[start].register_forward_pre_hook(first, with_kwargs=True)]
    handles += [blk.register_forward_pre_hook(later, with_kwargs=True) for blk in found[start + 1 :]]
    if share_attention:
        handles.append(adapter.attn_modules[start].register_forward_pre_hook(core_in, with_kwargs=True))
        handles.append(adapter.out_projs[start].register_forward_pre_hook(core_out, prepend=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


__all__ = ["blocks", "fan_out"]
