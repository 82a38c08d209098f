"""The cost model's vocabulary: a shape, a cost, hardware, and the table of formulas the backends register."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

import torch

import headlab.checks as checks
from headlab.errors import ConfigError, CostModelError, UnknownBackendError
from headlab.spec.attention_spec import AttentionSpec, function_mask_shape
from headlab.spec.masks import MaskFn

_DTYPES = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of float16, bfloat16, float32, float64") from None


@dataclass(frozen=True)
class AttentionShape:
    """One attention workload: a stack of ``layers`` identical attention calls.

    >>> AttentionShape(heads=32, q_len=4096, layers=32, dtype="float16").kv_len
    4096
    """

    heads: int = 8  # query heads H
    q_len: int = 1024  # query positions
    batch: int = 1
    # None: the default, filled in by __post_init__ (so each is an int once built)
    kv_heads: int = None  # type: ignore[assignment]  # key/value heads (GQA); default H
    kv_len: int = None  # type: ignore[assignment]  # key positions; default q_len
    head_dim: int = 128  # of q and k (128 = 4096-wide model with 32 heads)
    v_dim: int = None  # type: ignore[assignment]  # of v; default head_dim
    layers: int = 1  # identical attention calls in sequence (one per transformer layer)
    dtype: str | torch.dtype = "float32"
    causal: bool = False  # torch's is_causal
    mask: MaskFn | None = None  # a mask function; sparse costs count the tiles its block map visits
    dropout_p: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.kv_len is None:
            object.__setattr__(self, "kv_len", self.q_len)
        if self.v_dim is None:
            object.__setattr__(self, "v_dim", self.head_dim)
        for name in ("heads", "q_len", "batch", "kv_heads", "kv_len", "head_dim", "v_dim", "layers"):
            object.__setattr__(self, name, checks.positive_int(name, getattr(self, name)))
        checks.in_range("dropout_p", self.dropout_p, 0, 1, high_open=True)
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=parse_dtype(self.dtype)).element_size()  # parse_dtype: a no-op once built

    def spec(self, *, requires_grad: bool = False, device: str = "cpu") -> AttentionSpec:
        """The :class:`AttentionSpec` of one layer's call (what backends' memory formulas read)."""
        kind: Literal["function", "none"] = "function" if self.mask is not None else "none"
        mask_shape = (
            function_mask_shape(self.mask, self.batch, self.heads, self.q_len, self.kv_len)
            if self.mask is not None
            else None
        )
        return AttentionSpec(
            batch=self.batch,
            heads=self.heads,
            kv_heads=self.kv_heads,
            q_len=self.q_len,
            kv_len=self.kv_len,
            head_dim=self.head_dim,
            v_dim=self.v_dim,
            dtype=parse_dtype(self.dtype),
            device=torch.device(device),
            causal=self.causal,
            mask_kind=kind,
            mask_shape=mask_shape,
            dropout_p=self.dropout_p,
            requires_grad=requires_grad,
        )

    def visible_pairs(self) -> int:
        """(query, key) pairs that are not masked out by ``causal``, per (batch, head)."""
        lq, lk = self.q_len, self.kv_len
        if not self.causal:
            return lq * lk
        full_rows = max(0, lq - lk)  # rows i >= lk see every key
        m = min(lq, lk)
        return m * (m + 1) // 2 + full_rows * lk

    def io_bytes(self) -> int:
        """Bytes of q, k, v and the output of one layer."""
        b, s = self.batch, self.itemsize
        return (
            s
            * b
            * (
                self.heads * self.q_len * (self.head_dim + self.v_dim)
                + self.kv_heads * self.kv_len * (self.head_dim + self.v_dim)
            )
        )


@dataclass(frozen=True)
class AttentionCost:
    """Predicted cost of an :class:`AttentionShape` on one backend. Totals are over all layers,
    except ``working_set_bytes``, the peak transient of one layer's forward call."""

    backend: str
    forward_flops: int  # multiply-adds x2 of the matmuls the backend executes, all layers
    backward_flops: int  # the same for the backward pass (recomputation included)
    attention_weights_bytes: int  # bytes of attention maps materialised, all layers (0: never held)
    working_set_bytes: int  # peak extra memory of one layer's forward call
    bytes_moved: int  # bytes read and written from main memory in the forward pass, all layers
    saved_for_backward_bytes: int  # what autograd keeps between forward and backward, all layers
    notes: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Hardware:
    """A machine, described by the user: peak FLOP/s and memory bandwidth (bytes/s)."""

    name: str
    peak_flops: float  # per second, at the dtype of interest
    bandwidth: float  # bytes per second
    memory_bytes: int | None = None

    def seconds(self, cost: AttentionCost, *, backward: bool = False) -> float:
        """Roofline lower bound: the slower of compute and memory traffic."""
        flops = cost.forward_flops + (cost.backward_flops if backward else 0)
        moved = cost.bytes_moved * (3 if backward else 1)
        return max(flops / self.peak_flops, moved / self.bandwidth)

    def __post_init__(self) -> None:
        for name in ("peak_flops", "bandwidth"):  # a zero divides by zero, a negative or inf gives a wrong time
            checks.positive_float(f"Hardware {name}", getattr(self, name), what=" (per second)")
        if self.memory_bytes is not None:
            checks.positive_int("Hardware memory_bytes", self.memory_bytes, what=" or None")


CostFormula = Callable[..., AttentionCost]  # formula(shape, backend) -> AttentionCost


class CostedBackend(Protocol):
    """What a formula may ask of the backend it costs (:class:`headlab.attention.backends.Backend`):
    its name, its configuration (tile sizes, feature map: attributes a formula documents), and its
    memory formula."""

    @property
    def name(self) -> str: ...  # read-only here: a backend class declares it (a ClassVar)

    def working_set_bytes(self, spec: AttentionSpec) -> int: ...

    def materializes(self, spec: AttentionSpec) -> bool: ...


# Filled by the backend registry: ``register`` in headlab.attention.backends gives every backend's formula
# and its registered instance, so costs never imports a backend.
_FORMULAS: dict[str, CostFormula] = {}
_BACKENDS: dict[str, CostedBackend] = {}


def register_cost(backend: str, *, instance: CostedBackend | None = None) -> Callable[[CostFormula], CostFormula]:
    """Decorator: ``@register_cost("mine") def mine_cost(shape, backend) -> AttentionCost``.

    A backend class declares its formula (``cost = staticmethod(mine_cost)``) and the backend registry
    calls this with the registered ``instance``; the formula then receives that instance (or a
    configured one passed to :func:`estimate`) as ``backend``. A formula of ``shape`` alone works too.
    """

    def deco(fn: CostFormula) -> CostFormula:
        _FORMULAS[backend] = fn
        if instance is not None:
            _BACKENDS[backend] = instance
        return fn

    return deco


def registered(name: str) -> CostedBackend:
    """The instance registered as backend ``name`` (what a formula's defaults, such as tile sizes, read)."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(
            f"unknown backend {name!r}; known backends: {', '.join(['auto', *_BACKENDS])}"
        ) from None


def estimate(shape: AttentionShape, backend: str | CostedBackend) -> AttentionCost:
    """Predicted cost of ``shape`` on ``backend``.

    ``backend`` is a registered name or a configured backend object (``linear.from_string("favor:256")``,
    ``TiledBackend(block_q=64, block_k=64)``): the formula its class declares then sees that instance.
    Raises :class:`~headlab.errors.CostModelError` for a backend without a formula (never zero).
    """
    if not isinstance(shape, AttentionShape):
        raise ConfigError(
            f"estimate costs an AttentionShape, got {type(shape).__name__}; build one, e.g. "
            "costs.AttentionShape(heads=32, q_len=4096)"
        )
    if isinstance(backend, str):
        name, instance = backend, _BACKENDS.get(backend)
        formula = _FORMULAS.get(name)
    elif not isinstance(getattr(backend, "name", None), str):  # a list or a number: AttributeError before
        raise UnknownBackendError(
            f"unknown backend {backend!r}: give a backend name (one of "
            f"{', '.join(['auto', *_BACKENDS])}) or a backend object"
        )
    else:
        name, instance = backend.name, backend
        formula = getattr(type(backend), "cost", None) or _FORMULAS.get(name)
    if formula is None:
        if instance is None:
            registered(name)  # raises UnknownBackendError listing the known ones
        raise CostModelError(f"backend {name!r} has no cost formula; known formulas: {', '.join(_FORMULAS)}")
    params = inspect.signature(formula).parameters
    if "backend" in params:
        return formula(shape, backend=instance)
    return formula(shape)


def estimate_all(shape: AttentionShape) -> dict[str, AttentionCost]:
    """Costs for every registered backend (each has a formula: the registry refuses one without)."""
    return {name: estimate(shape, name) for name in _BACKENDS}


def formulas() -> list[str]:
    return list(_FORMULAS)
