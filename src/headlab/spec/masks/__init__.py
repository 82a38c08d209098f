"""Mask functions: *which* scores count, as data.

A mask function answers, for a batch index ``b``, head ``h``, query position ``q_idx`` and
key position ``kv_idx``, whether the query may attend to the key (True = may attend, the
convention of :func:`torch.nn.functional.scaled_dot_product_attention` and FlexAttention).
Indices arrive as broadcastable integer tensors, so a mask is written with tensor
operations and evaluated for a whole tile at once::

    >>> import headlab
    >>> from headlab import masks
    >>> m = masks.causal() & masks.padding([3, 4])
    >>> m.dense(batch=2, heads=1, q_len=4, kv_len=4)[0, 0].int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 0]], dtype=torch.int32)

Masks compose with ``&``, ``|`` and ``~``. Any plain function ``f(b, h, q_idx, kv_idx)``
written with tensor operations can be passed where a mask is expected; :func:`as_mask`
wraps it. A mask that needs the sequence lengths (``causal_lower_right``) receives them
when it is evaluated.

``causal`` vs ``causal_lower_right`` when ``q_len != kv_len`` (here q_len=2, kv_len=4)::

    causal()  (top-left, torch is_causal)     causal_lower_right()  (query i is key i + kv_len - q_len)
        k0 k1 k2 k3                               k0 k1 k2 k3
    q0   1  0  0  0                           q0   1  1  1  0
    q1   1  1  0  0                           q1   1  1  1  1

The lower-right form is what decoding with a KV cache needs: the last query sees every key.

Every mask can be materialised densely (:meth:`MaskFn.dense`) for tests and pictures, and
compiled to a :class:`~headlab.spec.blocks.BlockMap`
(:func:`headlab.spec.blocks.block_map`) that tells a tiled kernel which tiles are empty,
partial or full.

Rooms: :mod:`.algebra` (``MaskFn``, composition, the basic masks), :mod:`.bands` (a mask's band
of visible offsets, read from its structure: :func:`band_of`), :mod:`.patterns` (offset patterns),
:mod:`.layouts` (global tokens, BigBird, block layouts, documents), :mod:`.parse`
(the text form); score modifications (FlexAttention's ``score_mod``: ``alibi``, ``softcap``,
``relative_bias``) come from :mod:`headlab.spec.score_mods` and are re-exported here.
"""

from headlab.spec.masks.algebra import MaskFn, as_mask, causal, causal_lower_right, full, padding
from headlab.spec.masks.bands import band_of
from headlab.spec.masks.layouts import bigbird, block_layout, documents, global_tokens
from headlab.spec.masks.parse import from_string, pattern, pattern_names
from headlab.spec.masks.patterns import dilated_window, fixed, sliding_window, strided
from headlab.spec.score_mods import ScoreMod, alibi, alibi_slopes, bias_tensor, relative_bias, softcap

__all__ = [
    "MaskFn",
    "as_mask",
    "causal",
    "causal_lower_right",
    "padding",
    "full",
    "sliding_window",
    "dilated_window",
    "strided",
    "fixed",
    "global_tokens",
    "bigbird",
    "block_layout",
    "documents",
    "from_string",
    "pattern",
    "pattern_names",
    "band_of",
    # score modifications (FlexAttention's score_mod), see headlab.spec.score_mods
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "bias_tensor",
    "relative_bias",
    "softcap",
]
