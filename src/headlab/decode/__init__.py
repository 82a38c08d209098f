"""Decoding with a KV cache shaped per head: policies (:mod:`headlab.kv`), the cache, :func:`generate`.

    headlab.generate(model, prompt, policy=headlab.kv.Policy.uniform(headlab.kv.window(4, 256)))

This package sits above ``interpret`` (a policy can come from an atlas or from head importance) and
below the CLI. Its names load on first use: importing the package registers the ``generate`` and
``train-gates`` instruments without importing transformers (the cache does), so a command's refusal that
needs no model stays quick.
"""

import sys as _sys
import types as _types
from importlib import import_module as _import_module

from headlab.decode import instrument  # noqa: F401  (registers the generate and train-gates instruments)

_LAZY = {
    "kv": "headlab.decode.kv",
    "passkey": "headlab.decode.passkey",
    "HeadCache": ("headlab.decode.cache", "HeadCache"),
    "Generation": ("headlab.decode.generate", "Generation"),
    "generate": ("headlab.decode.generate", "generate"),
    "perplexity": ("headlab.decode.generate", "perplexity"),
    "GateTraining": ("headlab.decode.train", "GateTraining"),
    "train_gates": ("headlab.decode.train", "train_gates"),
}


def __getattr__(name: str):
    if name in _LAZY:
        target = _LAZY[name]
        obj = _import_module(target) if isinstance(target, str) else getattr(_import_module(target[0]), target[1])
        globals()[name] = obj
        return obj
    raise AttributeError(f"module 'headlab.decode' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(_types.ModuleType):
    """``headlab.decode.generate`` is the function, as it always was: the import system, loading the submodule of
    the same name later, does not replace it (the submodule stays ``sys.modules["headlab.decode.generate"]``)."""

    def __setattr__(self, name: str, value) -> None:
        if name == "generate" and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


__all__ = ["GateTraining", "Generation", "HeadCache", "generate", "kv", "passkey", "perplexity", "train_gates"]
