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

from importlib import import_module as _import_module

from headlab._version import __version__ as __version__  # public: headlab.__version__

__all__ = [
    "MultiHeadAttention",
    "Result",
    "attention",
    "attention_weights",
    "backends",
    "costs",
    "errors",
    "masks",
    "read_json",
    "write_json",
]

# Every name loads on first use, so `import headlab` imports neither torch nor transformers (the command line's
# `headlab --help` and `headlab memory` stay quick and small); `headlab.attention(q, k, v)` imports the engines.
_LAZY = {
    "errors": "headlab.errors",
    "attention": "headlab.attention",  # a callable package: headlab.attention(q, k, v, ...)
    "masks": "headlab.spec.masks",  # headlab.masks is headlab.spec.masks (one module object)
    "attention_weights": ("headlab.attention.core", "attention_weights"),
    "backends": ("headlab.attention.core", "backends"),
    "MultiHeadAttention": ("headlab.attention.module", "MultiHeadAttention"),
    # every instrument's result in one envelope (kind, version, model, settings, figures): headlab.Result.load reads
    # any result file headlab writes, of this version or an earlier one
    "Result": ("headlab.results", "Result"),
    "read_json": ("headlab.results", "read_json"),
    "write_json": ("headlab.results", "write_json"),
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
    if not name.startswith("_"):  # a subpackage or module reached as an attribute: headlab.models.adapt(...)
        from importlib.util import find_spec

        if find_spec(f"headlab.{name}") is not None:
            return _import_module(f"headlab.{name}")
    raise AttributeError(f"module 'headlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
