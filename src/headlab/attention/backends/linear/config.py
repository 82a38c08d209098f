"""Configuration of linear attention: feature map names (one alias table), :class:`LinearConfig`,
the decoding state, seeds, and the working-set formula the guard and the cost model read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

import headlab.checks as checks
from headlab.errors import ConfigError
from headlab.spec.attention_spec import AttentionSpec

FeatureMapName = Literal["elu", "relu", "favor"]

# every name a feature map goes by (the text form, approximation diagnostics and the CLI read it)
FEATURE_MAP_ALIASES = {
    "elu": "elu",
    "elu+1": "elu",
    "linear": "elu",
    "relu": "relu",
    "favor": "favor",
    "favor+": "favor",
    "performer": "favor",
}
DEFAULT_FAVOR_FEATURES = 256
DEFAULT_CHUNK = 64


@dataclass(frozen=True)
class LinearConfig:
    """How a :class:`LinearBackend` computes. Validated on construction."""

    feature_map: FeatureMapName = "elu"  # elu + 1 is Katharopoulos et al.'s map and the default
    num_features: int | None = None  # FAVOR+ random features m; elu/relu have head_dim features
    seed: int = 0  # FAVOR+ draw; the same seed gives the same projection on every machine
    chunk_size: int = DEFAULT_CHUNK  # causal chunk C: memory O(n (F + C)) when C >= d_v
    redraw_every: int = 0  # FAVOR+ in training mode: new features every N calls (0: never)

    def __post_init__(self) -> None:
        fm = FEATURE_MAP_ALIASES.get(str(self.feature_map).lower())
        if fm is None:
            raise ConfigError(f"unknown feature map {self.feature_map!r}; use one of elu, relu, favor")
        object.__setattr__(self, "feature_map", fm)
        if fm == "favor":
            m = DEFAULT_FAVOR_FEATURES if self.num_features is None else self.num_features
            m = checks.positive_int(
                "num_features",
                m,
                message="FAVOR+ needs a positive whole number of random "
                "features, got num_features={value!r}; try num_features="
                f"{DEFAULT_FAVOR_FEATURES} (more features: smaller error, more time)",
            )
            object.__setattr__(self, "num_features", m)
        elif self.num_features is not None:
            raise ConfigError(
                f"feature map {fm!r} has head_dim features; num_features={self.num_features!r} applies to "
                "favor only (e.g. LinearBackend('favor', num_features=256))"
            )
        object.__setattr__(self, "chunk_size", checks.positive_int("chunk_size", self.chunk_size))
        object.__setattr__(
            self, "redraw_every", checks.non_negative_int("redraw_every", self.redraw_every, what=" (0: never)")
        )
        object.__setattr__(self, "seed", checks.integer("seed", self.seed))

    def label(self) -> str:
        if self.feature_map == "favor":
            return f"favor:{self.num_features} seed={self.seed}"
        return self.feature_map

    def features(self, head_dim: int) -> int:
        """Number of features F for a head dim: ``head_dim`` for elu/relu, ``num_features`` for favor."""
        if self.feature_map == "favor":
            assert self.num_features is not None  # set by __post_init__ for favor
            return self.num_features
        return head_dim


@dataclass
class LinearState:
    """Recurrent state of causal linear attention, per (batch, kv head).

    ``kv = sum_j phi(k_j) v_j^T * exp(-offset)`` ``(B, Hkv, F, d_v)``,
    ``z = sum_j phi(k_j) * exp(-offset)`` ``(B, Hkv, F)``; ``offset`` ``(B, Hkv)`` is a running
    maximum of FAVOR+ key exponents kept out of the sums so they cannot overflow (zeros for
    elu/relu; it cancels in the output). ``position`` counts the tokens seen.
    """

    kv: torch.Tensor
    z: torch.Tensor
    offset: torch.Tensor
    position: int = 0


def mix_seed(*parts: int) -> int:
    """One 63-bit seed from several integers (splitmix64 over each in turn): nearby inputs give
    unrelated streams, the same inputs the same stream."""
    x = 0
    for part in parts:
        x = (x ^ (int(part) & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x >> 1


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Features and sums run in float32 for half inputs (sums of n positive terms overflow fp16)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def working_set_bytes(spec: AttentionSpec, num_features: int | None = None, chunk_size: int = DEFAULT_CHUNK) -> int:
    """Peak extra bytes of one forward call (no grad), output included.

    Non-causal: the features of q and k, the ``F x d_v`` state and the output. Causal (chunk C,
    N = n / C chunks, E = d_v + 1): features, v with its ones column, and the larger of the prefix
    phase (chunk states, their running sums and the exclusive prefix: ``3 N F E``) and the block
    phase (prefix, ``n x C`` blocks, two ``n x E`` partial outputs). No term grows as ``n^2`` or
    ``n F d_v``. Measured peaks agree within a few percent (``benchmarks/bench_linear.py``)."""
    Fn = num_features or spec.head_dim
    s = torch.empty((), dtype=compute_dtype(spec.dtype)).element_size()
    B, H, Hk, Lq, Lk, Dv = spec.batch, spec.heads, spec.kv_heads, spec.q_len, spec.kv_len, spec.v_dim
    E = Dv + 1
    if not spec.causal:
        total = B * (H * Lq + Hk * Lk) * Fn  # features (FAVOR+ exponentiates its projections in place)
        total += B * Hk * Fn * E + B * H * Lq * E  # states, output and its denominator
        return total * s
    C = min(chunk_size, Lq)
    N = -(-Lq // C)
    L = N * C
    total = B * (H + Hk) * L * Fn + B * Hk * L * E  # features, v with its ones column (padded to L)
    states = B * Hk * N * Fn * E
    total += max(3 * states, states + B * H * L * C + 2 * B * H * L * E)
    return total * s
