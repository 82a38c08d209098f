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
resid_post    (B, L, E)   the stream leaving the block (its output; the next block's ``resid_pre``)
mlp_out       (B, L, E)   what the block's MLP returns, before the block adds it to the stream (and
                          before a post-feedforward norm, Gemma 2, OLMo 2)
============  ==========  ===========================================================================

``resid_pre``, ``resid_post`` and ``mlp_out`` (:data:`RESID_KINDS`) can also be *edited*, like the sites
inside attention (``fn(tensor, site) -> tensor``): an edit of ``resid_pre`` replaces the block's input (the
stream its attention, its MLP and its residual connection read), of ``resid_post`` its output, of
``mlp_out`` the MLP's output. They hook the block and the MLP the adapter names
(:meth:`~headlab.models.base.ModelAdapter.block`, :meth:`~headlab.models.base.ModelAdapter.mlp`): models
with one stack of unshared blocks; ``mlp_out`` where the MLP is one module called on the stream alone.

They are named like the attention sites (``blocks.{l}.attn.resid_pre``) and come from forward hooks
on the modules the adapter names (:meth:`~headlab.models.base.ModelAdapter.attention_norm`); the hooks
live only while a capture asks for them. A module shared by several layers (ALBERT) records only the
layer it is computing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

STREAM_KINDS = ("input", "resid_pre", "norm_in", "parallel_out", "resid_post", "mlp_out")
RESID_KINDS = ("resid_pre", "resid_post", "mlp_out")  # editable


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
            if kinds & {"resid_pre", "norm_in", "parallel_out"}:
                norms = adapter.attention_norm(layer)  # UnsupportedArchitectureError before the run
                if "resid_pre" in kinds and norms.pre is not None:
                    handles.append(norms.pre.register_forward_pre_hook(input_of(layer, "resid_pre"), with_kwargs=True))
                if "norm_in" in kinds and norms.post is not None:
                    handles.append(norms.post.register_forward_pre_hook(input_of(layer, "norm_in"), with_kwargs=True))
                if "parallel_out" in kinds and norms.parallel is not None:
                    handles.append(norms.parallel.register_forward_hook(output_of(layer, "parallel_out")))
            if "resid_post" in kinds:
                handles.append(adapter.block(layer).register_forward_hook(output_of(layer, "resid_post")))
            if "mlp_out" in kinds:
                handles.append(adapter.mlp(layer).register_forward_hook(output_of(layer, "mlp_out")))
        yield
    finally:
        for h in handles:
            h.remove()


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _with_first(x, t):
    return (t, *x[1:]) if isinstance(x, tuple) else t


@contextmanager
def stream_edit_hooks(adapter, chosen: dict[int, set[str]]) -> Iterator[None]:
    """Attach the hooks that apply the edits of :data:`RESID_KINDS` (``{layer: kinds}``; the edit functions
    are on the layer's state, as for the attention sites), for the block."""
    from headlab.models.sites import apply_edits

    handles = []

    def block_input(state):
        def hook(module, args, kwargs):
            if args:
                return (apply_edits(state, "resid_pre", args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": apply_edits(state, "resid_pre", kwargs["hidden_states"])}

        return hook

    def output(state, kind):
        def hook(module, args, out):
            return _with_first(out, apply_edits(state, kind, _first(out)))

        return hook

    try:
        for layer, kinds in chosen.items():
            state = adapter.states[layer]
            if "resid_pre" in kinds:
                handles.append(adapter.block(layer).register_forward_pre_hook(block_input(state), with_kwargs=True))
            if "resid_post" in kinds:
                handles.append(adapter.block(layer).register_forward_hook(output(state, "resid_post")))
            if "mlp_out" in kinds:
                handles.append(adapter.mlp(layer).register_forward_hook(output(state, "mlp_out")))
        yield
    finally:
        for h in handles:
            h.remove()


__all__ = ["RESID_KINDS", "STREAM_KINDS", "stream_edit_hooks", "stream_hooks"]
