"""Decoding with a KV cache shaped per head: policies (:mod:`headlab.kv`), the cache, :func:`generate`.

    headlab.generate(model, prompt, policy=headlab.kv.Policy.uniform(headlab.kv.window(4, 256)))

This package sits above ``interpret`` (a policy can come from an atlas or from head importance) and
below the CLI.
"""

from headlab.decode import kv, passkey
from headlab.decode.cache import HeadCache
from headlab.decode.generate import Generation, generate, perplexity
from headlab.decode.train import GateTraining, train_gates

# isort: split
from headlab.decode import instrument  # noqa: F401  (last: registers the generate and train-gates instruments)

__all__ = ["GateTraining", "Generation", "HeadCache", "generate", "kv", "passkey", "perplexity", "train_gates"]
