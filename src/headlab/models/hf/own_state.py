"""The state of the bridge on one model (:mod:`headlab.models.hf.own_bridge`): which implementation its bridged
modules hand their attention to, and which modules they are. Apart from the bridge so that the seams that switch
implementations (:func:`headlab.models.hf.trace.implementation`, the adapters' backends) read it without importing
the bridge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SERVED = ("headlab", "headlab_trace")  # the implementations a bridged module hands its attention to


@dataclass
class Bridge:
    """The bridge of one model: its implementation (None: the model's own math) and its bridged modules."""

    impl: str | None = None
    modules: list[str] = field(default_factory=list)  # paths from the model's root
    repeats: dict[str, int] = field(default_factory=dict)  # path -> r (keys and values repeated r times)
    kinds: dict[str, str] = field(default_factory=dict)  # path -> "math" (its own softmax) or "sdpa"


def bridge_of(model: Any) -> Bridge | None:
    """The bridge installed on ``model`` (or on the model it wraps), if any."""
    b = getattr(model, "_headlab_own", None)
    return b if isinstance(b, Bridge) else None


BRIDGED: set[str] = set()  # config keys (headlab.models.hf.verify.config_key) whose view was read through the bridge


def computes_its_own(model: Any, key: str) -> bool:
    """Was a model of config key ``key`` (its class, config and module tree) found to compute attention with its own
    math, and is this instance not bridged yet? (Another instance of it, or a copy in another dtype, needs the bridge
    too: the view cached for the key is the bridge's.)"""
    return key in BRIDGED and bridge_of(model) is None


def set_implementation(model: Any, name: str) -> str | None:
    """Switch a bridged model to implementation ``name``; returns the one it had (None: its own math)."""
    b = bridge_of(model)
    assert b is not None
    saved = b.impl
    b.impl = name if name in SERVED else None
    return saved


__all__ = ["BRIDGED", "Bridge", "SERVED", "bridge_of", "computes_its_own", "set_implementation"]
