"""Record-only sites around each attention layer: its input and the residual stream it sits on.

Beside the sites inside attention (:mod:`headlab.models.sites`), a capture can record what flows
around each attention layer ``l`` (batch first, ``E`` the residual width):

============  ==========  ===========================================================================
kind          shape       what
============  ==========  ===========================================================================
input         (B, L, E)   the tensor the layer's keys and values are computed from: the attention
                          module's input (after a pre-norm), or the encoder's output for cross-attention
resid_pre     (B, L, E)   the stream entering the block: the pre norm's input, or the attention's
                          input in a block without a pre norm
norm_in       (B, L, E)   the post norm's input (``x + Attn(x)`` post-LN, ``Attn(x)`` sandwich);
                          absent in pre-norm blocks
parallel_out  (B, L, E)   the parallel MLP's output (GPT-J, GPT-NeoX, Phi, Falcon); absent elsewhere
============  ==========  ===========================================================================

They are named like the attention sites (``blocks.{l}.attn.resid_pre``) and come from forward hooks
on the modules the adapter names (:meth:`~headlab.models.base.ModelAdapter.attention_norm`); the hooks
live only while a capture asks for them. A module shared by several layers (ALBERT) records only the
layer it is computing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

STREAM_KINDS = ("input", "resid_pre", "norm_in", "parallel_out")


def _current(adapter, layer: int) -> bool:
    """Is the (possibly shared) attention module computing layer ``layer`` now?"""
    return getattr(adapter.attn_modules[layer], "_headlab", None) is adapter.states[layer]


@contextmanager
def stream_hooks(adapter, probe) -> Iterator[None]:
    """Attach the hooks that record the :data:`STREAM_KINDS` ``probe`` wants, for the block."""
    handles = []

    def record(layer, kind, t):
        probe.record(layer, kind, t.detach().clone())  # clone: Falcon adds into its MLP output in place

    def attn_pre(layer):
        def hook(module, args, kwargs):
            if _current(adapter, layer):
                x = adapter.value_input(layer, args, kwargs)
                if probe.wants(layer, "input"):
                    record(layer, "input", x)
                if probe.wants(layer, "resid_pre") and adapter.attention_norm(layer).pre is None:
                    record(layer, "resid_pre", x)
        return hook

    def input_of(layer, kind):
        def hook(module, args, kwargs):
            if _current(adapter, layer):
                record(layer, kind, args[0] if args else next(iter(kwargs.values())))
        return hook

    def output_of(layer, kind):
        def hook(module, args, output):
            if _current(adapter, layer):
                record(layer, kind, output[0] if isinstance(output, tuple) else output)
        return hook

    try:
        for layer in range(adapter.n_layers):
            kinds = {k for k in STREAM_KINDS if probe.wants(layer, k)}
            if not kinds:
                continue
            if kinds & {"input", "resid_pre"}:
                handles.append(adapter.attn_modules[layer].register_forward_pre_hook(attn_pre(layer), with_kwargs=True))
            if kinds - {"input"}:
                norms = adapter.attention_norm(layer)  # UnsupportedArchitectureError before the run
                if "resid_pre" in kinds and norms.pre is not None:
                    handles.append(norms.pre.register_forward_pre_hook(input_of(layer, "resid_pre"), with_kwargs=True))
                if "norm_in" in kinds and norms.post is not None:
                    handles.append(norms.post.register_forward_pre_hook(input_of(layer, "norm_in"), with_kwargs=True))
                if "parallel_out" in kinds and norms.parallel is not None:
                    handles.append(norms.parallel.register_forward_hook(output_of(layer, "parallel_out")))
        yield
    finally:
        for h in handles:
            h.remove()


__all__ = ["STREAM_KINDS", "stream_hooks"]
