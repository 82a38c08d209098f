"""Capture what each attention head computes: :func:`capture` returns an :class:`ActivationCache`.

Sites are named ``blocks.{layer}.attn.{kind}`` (globs allowed: ``"blocks.*.attn.pattern"``); exactly
what each holds is defined in :mod:`headlab.models.sites`:

=========  =====================  ===============================================================
kind       shape                  what
=========  =====================  ===============================================================
q          (B, H, Lq, d)          queries as the scores see them (after rotary embeddings)
k, v       (B, Hkv, Lk, d)        keys, values (query head h reads kv head h // (H // Hkv))
pattern    (B, H, Lq, Lk)         attention weights; equal to Hugging Face's ``output_attentions``
z          (B, H, L, d)           per-head outputs ``pattern_h @ v_h``, before the gates and W^O
head_out   (B, H, L, E)           per-head contributions ``gates[l, h] * z_h @ W_O[h]`` (bias excluded;
                                  they sum over h to the output projection minus its bias)
stats      (object)               per-head statistics without maps, from ``headlab.attention_stats``
=========  =====================  ===============================================================

Around each attention layer (:mod:`headlab.models.stream_sites`): ``input`` (what its keys and values
are computed from, ``(B, L, E)``), ``resid_pre`` (the stream entering the block), ``resid_post`` (the
stream leaving it), ``mlp_out`` (its MLP's output), ``norm_in`` (the post norm's input) and
``parallel_out`` (a parallel MLP's output); ``resid_pre``, ``resid_post`` and ``mlp_out`` can be edited
too, the others are record-only. They are never part of the default ``sites=None``.

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

Edits at the same sites (``fn(tensor, site) -> tensor``) apply during the run; the cache holds what
the model computed with:

    >>> zero_head_2 = lambda z, site: z * (torch.arange(4) != 2).view(1, 4, 1, 1)
    >>> c = headlab.capture(m, ids, "blocks.0.attn.z", edits={"blocks.0.attn.z": zero_head_2})
    >>> float(c["blocks.0.attn.z"][:, 2].abs().sum())
    0.0

On a model sharded by tensor parallelism (:mod:`headlab.models.tensor_parallel`, every rank calling alike)
each rank records its own heads, statistics included, and ``gather`` says where they go: to every rank in
global head order (``"all"``, the default), to rank 0 alone (``"rank0"``; the other ranks get an empty
cache), or nowhere (``"none"``; ``cache.heads(site)`` gives the global indices each rank holds).

    >>> c.heads("blocks.0.attn.z")  # one process: every head
    range(0, 4)
"""

from headlab.interpret.capture.cache import ActivationCache
from headlab.interpret.capture.probe import Probe
from headlab.interpret.capture.run import capture

__all__ = ["ActivationCache", "Probe", "capture"]
