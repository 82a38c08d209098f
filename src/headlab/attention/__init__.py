"""The mechanism: the functional core, mask functions, the module and the backends.

Knows nothing of models or interpretation. Tensor convention: q/k/v ``(batch, heads, seq, head_dim)``,
attention maps ``(batch, heads, q_pos, k_pos)``.

This package is also callable: ``headlab.attention(q, k, v, ...)`` is
:func:`headlab.attention.core.attention`, while ``headlab.attention.masks``,
``headlab.attention.backends`` ... stay importable as subpackages.
"""

import sys as _sys
import types as _types

from headlab.attention import masks
from headlab.attention.blocks import BlockMap
from headlab.attention.core import attention as _attention_fn
from headlab.attention.core import attention_weights
from headlab.attention.module import MultiHeadAttention
from headlab.attention.spec import AttentionSpec

__all__ = ["AttentionSpec", "BlockMap", "MultiHeadAttention", "attention_weights", "masks"]


class _CallableModule(_types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _attention_fn(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
__doc__ = (__doc__ or "") + "\n\n" + (_attention_fn.__doc__ or "")
