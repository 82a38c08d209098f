"""The engines of the mechanism: the functional core, the module, the backends and the statistics.

Knows nothing of models or interpretation. Tensor convention: q/k/v ``(batch, heads, seq, head_dim)``,
attention maps ``(batch, heads, q_pos, k_pos)``.

This package is also callable: ``headlab.attention(q, k, v, ...)`` is
:func:`headlab.attention.core.attention`, while ``headlab.attention.backends`` ... stay importable as
subpackages. What attention is asked to compute (the spec, masks, score mods, visibility, block maps, tile
states, feature maps, the memory guard) lives below ``headlab.costs``, in :mod:`headlab.spec` (import it from
there: ``headlab.spec.masks``; ``headlab.attention.masks`` is the same module, re-exported as a name).
"""

import sys as _sys
import types as _types

from headlab.attention.core import attention as _attention_fn
from headlab.attention.core import attention_weights
from headlab.attention.module import MultiHeadAttention
from headlab.spec import masks
from headlab.spec.attention_spec import AttentionSpec
from headlab.spec.blocks import BlockMap

__all__ = ["AttentionSpec", "BlockMap", "MultiHeadAttention", "attention_weights", "masks"]


class _CallableModule(_types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _attention_fn(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
__doc__ = (__doc__ or "") + "\n\n" + (_attention_fn.__doc__ or "")
