"""The backend interface and registry.

A backend is one way of computing attention. Each declares what it supports as data
(:class:`Capabilities`, exactness included) and answers ``supports(spec) -> (ok, reason)`` for a
concrete call; ``backend="auto"`` picks the preferred exact backend that supports the call. Each also
declares its cost formula (``cost``, from :mod:`headlab.costs`) and its memory formula
(:meth:`Backend.working_set_bytes`): :func:`register` refuses a class without a formula and hands it
to the cost model, so ``headlab.costs.estimate(shape, name)`` asks the backend, never a list of names.
Everything else that needs to know about a backend asks it too: :func:`is_exact` (its capabilities).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from headlab.costs.model import CostFormula, register_cost
from headlab.errors import BackendUnsupportedError, CostModelError, MemoryBudgetError, UnknownBackendError
from headlab.registry import Registry
from headlab.spec.attention_spec import AttentionSpec
from headlab.spec.masks import MaskFn

ALL_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do. Each field is a yes/no a user asks before choosing it."""

    dtypes: frozenset = ALL_FLOATS  # input dtypes accepted
    bool_mask: bool = True  # boolean tensor masks
    additive_mask: bool = True  # additive float tensor masks (torch SDPA's float attn_mask)
    mask_fn: bool = True  # headlab.masks mask functions
    causal: bool = True  # causal=True
    gqa: bool = True  # grouped-query heads without copying K/V per query head
    dropout: bool = True  # dropout_p > 0
    grad: bool = True  # backward pass
    returns_weights: bool = False  # can return the (B, H, Lq, Lk) weights
    returns_lse: bool = True  # can return the log-sum-exp (B, H, Lq) (return_lse=True)
    score_mod: bool = False  # FlexAttention-style score_mod(score, b, h, q_idx, kv_idx)
    exact: bool = True  # exact softmax attention (False: an approximation)
    materializes: bool = False  # holds an n x n map in memory
    devices: frozenset = field(default_factory=lambda: frozenset({"cpu", "cuda"}))

    def as_dict(self) -> dict:
        return {
            "dtypes": sorted(str(d).removeprefix("torch.") for d in self.dtypes),
            "bool_mask": self.bool_mask,
            "additive_mask": self.additive_mask,
            "mask_fn": self.mask_fn,
            "causal": self.causal,
            "gqa": self.gqa,
            "dropout": self.dropout,
            "grad": self.grad,
            "returns_weights": self.returns_weights,
            "returns_lse": self.returns_lse,
            "score_mod": self.score_mod,
            "exact": self.exact,
            "materializes": self.materializes,
            "devices": sorted(self.devices),
        }


class Backend:
    """Base class. Subclasses set ``name``, ``summary``, ``capabilities``, ``priority`` and ``cost``
    and implement :meth:`forward` and :meth:`working_set_bytes`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    # the cost formula, formula(shape, backend) -> headlab.costs.AttentionCost, e.g.
    # `cost = staticmethod(costs.tiled.tiled_cost)`; it reads this instance's configuration and memory formula
    cost: ClassVar[CostFormula]
    # auto picks the exact backend with the lowest priority that supports the call
    priority: ClassVar[int] = 100
    # suggested when this backend refuses a call
    alternative: ClassVar[str | None] = None

    def supports(self, spec: AttentionSpec) -> tuple[bool, str]:
        c = self.capabilities
        if spec.dtype not in c.dtypes:
            return False, f"dtype {str(spec.dtype).removeprefix('torch.')} is not supported"
        if spec.device.type not in c.devices:
            return False, f"device {spec.device.type} is not supported"
        if spec.mask_kind == "bool" and not c.bool_mask:
            return False, "boolean tensor masks are not supported"
        if spec.mask_kind == "additive" and not c.additive_mask:
            return False, "additive float masks are not supported"
        if spec.mask_kind == "function" and not c.mask_fn:
            return False, "mask functions are not supported"
        if spec.score_mod and not c.score_mod:
            return False, "score_mod is not supported"
        if spec.need_lse and not c.returns_lse:
            return False, "returning the log-sum-exp is not supported"
        if spec.causal and not c.causal:
            return False, "causal=True is not supported"
        if spec.dropout_p > 0 and not c.dropout:
            return False, "dropout is not supported"
        if spec.requires_grad and not c.grad:
            return False, "gradients are not supported"
        if spec.need_weights and not c.returns_weights:
            return False, "returning attention weights is not supported"
        return True, ""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        *,
        mask: torch.Tensor | MaskFn | None,
        scale: float,
        score_mod=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Return ``(out (B, H, Lq, v_dim), weights (B, H, Lq, Lk) or None, lse (B, H, Lq) or None)``:
        weights when ``spec.need_weights``; the natural-log log-sum-exp (``-inf`` on rows that see
        no key) when ``spec.need_lse`` (a backend may return it always)."""
        raise NotImplementedError

    def working_set_bytes(self, spec: AttentionSpec) -> int:
        """Peak extra bytes of one call described by ``spec`` (the memory guard and the cost formula read it)."""
        raise NotImplementedError(f"backend {self.name!r} has no memory formula")

    def materializes(self, spec: AttentionSpec) -> bool:
        """Whether this call holds the ``(B, H, Lq, Lk)`` map (default: the capability; sdpa decides per call)."""
        return self.capabilities.materializes

    def check_memory(self, spec: AttentionSpec) -> None:
        """Refuse before allocating when the call cannot fit (materialising backends override)."""

    def __repr__(self) -> str:
        return f"<headlab backend {self.name!r}>"


def _unknown(name: str, known: list[str]) -> UnknownBackendError:
    return UnknownBackendError(f"unknown backend {name!r}; known backends: {', '.join(['auto', *known])}")


BACKENDS: Registry[Backend] = Registry("a backend", "calls choose it by name", instances=False, unknown=_unknown)
# {name: backend}, live: what the functions below read and write (a test may swap it for a copy of its own)
_REGISTRY: MutableMapping[str, Backend] = BACKENDS.table


def register(backend_cls: type[Backend]) -> type[Backend]:
    """Class decorator: add a backend to the registry under ``backend_cls.name``, and its cost formula
    (``backend_cls.cost``) to the cost model's table. A class without a formula is refused."""
    formula = getattr(backend_cls, "cost", None)
    if not callable(formula):
        raise CostModelError(
            f"backend class {backend_cls.__name__} ({getattr(backend_cls, 'name', '?')!r}) declares no cost formula; "
            "set `cost = staticmethod(my_cost)` with my_cost(shape, backend) -> headlab.costs.AttentionCost "
            "(see headlab.costs.dense for the smallest ones) before registering it"
        )
    instance = backend_cls()
    register_cost(backend_cls.name, instance=instance)(formula)
    _REGISTRY[backend_cls.name] = instance
    return backend_cls


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str | Backend) -> Backend:
    """The backend registered as ``name`` (a :class:`Backend` instance passes through)."""
    if isinstance(name, Backend):
        return name
    try:
        return _REGISTRY[name]
    except KeyError:
        raise _unknown(name, list(_REGISTRY)) from None


def is_exact(backend: str | Backend | None) -> bool:
    """Whether ``backend`` computes exact softmax attention, as its capabilities say; ``None`` and ``"auto"``
    are (``auto`` picks only exact backends). The one question every analysis asks before trusting maps.

        >>> is_exact("tiled"), is_exact("auto"), is_exact("linear")
        (True, True, False)
    """
    return backend in (None, "auto") or bool(get(backend).capabilities.exact)


def exact_names() -> list[str]:
    """The registered backends that compute exact softmax attention (for messages that name them)."""
    return [n for n in _REGISTRY if _REGISTRY[n].capabilities.exact]


def choose(spec: AttentionSpec) -> Backend:
    """The backend ``backend="auto"`` uses for ``spec``: the exact one with the lowest priority
    that supports the call and fits in memory (a backend refused by the memory guard is passed
    over; when none fits, the first refusal is raised)."""
    reasons = []
    refused: MemoryBudgetError | None = None
    for b in sorted(_REGISTRY.values(), key=lambda b: b.priority):
        if not b.capabilities.exact:
            continue
        ok, why = b.supports(spec)
        if not ok:
            reasons.append(f"{b.name}: {why}")
            continue
        try:
            b.check_memory(spec)
        except MemoryBudgetError as e:
            refused = refused or e
            continue
        return b
    if refused is not None:
        raise refused
    raise BackendUnsupportedError("no backend supports this call (" + "; ".join(reasons) + ")")


def require(backend: Backend, spec: AttentionSpec) -> None:
    ok, why = backend.supports(spec)
    if not ok:
        alt = None
        for b in sorted(_REGISTRY.values(), key=lambda b: b.priority):
            if b is not backend and b.capabilities.exact and b.supports(spec)[0]:
                alt = b.name
                break
        hint = f"; use backend={alt!r}" if alt else ""
        raise BackendUnsupportedError(f"backend {backend.name!r} cannot serve this call: {why}{hint}")
