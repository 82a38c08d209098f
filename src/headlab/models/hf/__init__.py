"""Adapters for Hugging Face transformers v5 families, one registered class per family.

=========  ==================================  ==========================  =======================
family     model types                         attention / W^O              q, k, v weights
=========  ==================================  ==========================  =======================
bert       bert (MiniLM), roberta              layer.attention.self /       query, key, value
                                               layer.attention.output.dense (nn.Linear)
gpt2       gpt2                                h.attn / h.attn.c_proj       c_attn (Conv1D, fused)
llama      llama, mistral, qwen2 (GQA)         layers.self_attn / o_proj    q_proj, k_proj, v_proj
=========  ==================================  ==========================  =======================

A family is one class in this package (``bert.py``, ``gpt2.py``, ``llama.py``) decorated with
:func:`~headlab.models.hf.common.register`; the table of known model types, the message for an
unsupported architecture and the maximum positions are all read from the registered classes.

    >>> from headlab.models.hf import supported_model_types
    >>> supported_model_types()
    ['bert', 'roberta', 'gpt2', 'llama', 'mistral', 'qwen2']
"""

from __future__ import annotations

from headlab.models.hf import bert, gpt2, llama  # noqa: F401  (each registers its family)
from headlab.models.hf.common import (
    FAMILIES,
    HFAdapter,
    adapter_class,
    adapter_for,
    max_positions,
    supported_model_types,
    unsupported_message,
)

__all__ = ["FAMILIES", "HFAdapter", "adapter_class", "adapter_for", "max_positions", "supported_model_types",
           "unsupported_message"]
