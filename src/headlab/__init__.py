"""headlab: multi-head attention, what it costs, efficient ways to compute it, and instruments
that show what each head does.

    >>> import torch, headlab
    >>> q = k = v = torch.randn(1, 4, 16, 8)          # (batch, heads, seq, head_dim)
    >>> headlab.attention(q, k, v, causal=True).shape
    torch.Size([1, 4, 16, 8])
    >>> est = headlab.costs.estimate(headlab.costs.AttentionShape(heads=32, q_len=4096, layers=32, dtype="float16"), "reference")
    >>> est.attention_weights_bytes
    34359738368
"""

import sys as _sys
from importlib import import_module as _import_module

from headlab import errors
from headlab.spec import masks
from headlab import attention  # a callable package: headlab.attention(q, k, v, ...)

# one module object: `import headlab.masks` finds this entry, so headlab.masks is headlab.spec.masks
_sys.modules[__name__ + ".masks"] = masks
# measuring real calls runs the engines, so it lives in headlab.attention.measure (costs imports no engine);
# `headlab.costs.measure`, its former name, finds the same module object
from headlab.attention import measure as _measure  # noqa: E402

_sys.modules.setdefault(__name__ + ".costs.measure", _measure)
from headlab.attention.core import attention_weights, backends
from headlab.attention.module import MultiHeadAttention

from headlab._version import __version__
# every instrument's result in one envelope (kind, version, model, settings, figures): headlab.Result.load reads
# any result file headlab writes, of this version or an earlier one
from headlab.results import Result, read_json, write_json

__all__ = ["MultiHeadAttention", "Result", "attention", "attention_weights", "backends", "costs", "errors", "masks",
           "read_json", "write_json"]

# Heavier layers load on first use, so `import headlab` stays quick.
_LAZY = {
    "costs": "headlab.costs",
    "testing": "headlab.testing",
    # added by the statistics, models and interpretability work:
    "attention_stats": ("headlab.attention.stats", "attention_stats"),
    "load": ("headlab.models", "load"),
    "capture": ("headlab.interpret.capture", "capture"),
    "analyze": ("headlab.interpret.report.analyze_job", "analyze"),
    "probe": ("headlab.interpret.probing", "probe"),
    "head_importance": ("headlab.interpret.heads.importance", "head_importance"),
    "ablate": ("headlab.interpret.heads.ablation", "ablate"),
    "prune_heads": ("headlab.interpret.heads.prune", "prune_heads"),
    "attention_norms": ("headlab.interpret.flow.norms", "attention_norms"),
    "rollout": ("headlab.interpret.flow.rollout", "rollout"),
    "attention_flow": ("headlab.interpret.flow.maxflow", "attention_flow"),
    "explain": ("headlab.interpret.saliency", "explain"),
    # decoding with a KV cache shaped per head
    "generate": ("headlab.decode", "generate"),
    "kv": "headlab.decode.kv",
    # the head atlas and patching
    "atlas": ("headlab.interpret.atlas", "atlas"),
    "patch": ("headlab.interpret.patching", "patch"),
    # circuits: edges between heads (from headlab import circuits; headlab.circuits.edge_scores(...))
    "circuits": "headlab.interpret.circuits",
}


def __getattr__(name: str):
    if name in _LAZY:
        target = _LAZY[name]
        obj = _import_module(target) if isinstance(target, str) else getattr(_import_module(target[0]), target[1])
        globals()[name] = obj
        return obj
    raise AttributeError(f"module 'headlab' has no attribute {name!r}")
