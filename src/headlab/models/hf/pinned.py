"""Models transformers pins to eager attention, and why (the diagnosis behind a refusal).

transformers (5.x) lets a model switch its attention implementation (``model.set_attn_implementation``, which
headlab's tracing, backends and captures use) only when ``type(model)._can_set_attn_implementation()`` is True.
That classmethod reads the *source of the module defining the class* (``sys.modules[cls.__module__]``): when the
file has a line ``class <...Attention...>(nn.Module):`` it answers whether the text
``ALL_ATTENTION_FUNCTIONS.get_interface(`` occurs anywhere in it; a file without such a class answers True; a
source that cannot be read (a class defined in a notebook or REPL) answers False. The answer is cached on the class
(``_can_set_attn_implementation_cached_value``). When it is False, ``set_attn_implementation`` logs a warning and
leaves the model on eager, so a modelling file with hand-written attention classes that reaches the attention
function another way (``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``, transformers 4's idiom) is pinned,
and no module of it is seen calling the interface. The class flag ``_supports_attention_backend`` plays no part
in this: it only answers ``is_backend_compatible()`` (for serving engines).

:func:`pinned_reason` says which class is pinned and why; :func:`lifted` lifts the pin for a block (to tell a
pinned model whose modules call the interface from one whose modules compute attention themselves).
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from collections.abc import Iterator

from torch import nn

_ATTENTION_CLASS = re.compile(r"^class (\w*Attention\w*)\(nn\.Module\):", re.MULTILINE)
_LOOKED_FOR = "ALL_ATTENTION_FUNCTIONS.get_interface("


def pinned_classes(model: nn.Module) -> list[type]:
    """The classes of ``model`` and its sub-models (``PreTrainedModel`` modules) that transformers will not let
    switch their attention implementation."""
    out: list[type] = []
    for m in model.modules():
        can = getattr(type(m), "_can_set_attn_implementation", None)
        if can is None or type(m) in out or not hasattr(m, "config"):
            continue
        try:
            ok = bool(can())
        except Exception:  # noqa: BLE001  (a class whose check cannot run: not pinned by it)
            ok = True
        if not ok:
            out.append(type(m))
    return out


def _why(cls: type) -> str:
    mod = sys.modules.get(cls.__module__)
    where = getattr(mod, "__file__", None) or cls.__module__
    try:
        code = inspect.getsource(mod) if mod is not None else None
    except (OSError, TypeError):
        code = None
    if code is None:
        return (
            f"the source of its module {cls.__module__!r} cannot be read (a class defined in a notebook or a "
            "REPL), and transformers pins such a class to eager"
        )
    found = _ATTENTION_CLASS.findall(code)
    if found and _LOOKED_FOR not in code:
        names = ", ".join(found[:3]) + (" ..." if len(found) > 3 else "")
        return (
            f"its modelling file {where} defines hand-written attention classes ({names}) and never calls "
            f"`{_LOOKED_FOR}...)`, which is what transformers reads as support for switching"
        )
    return f"`{cls.__name__}._can_set_attn_implementation()` is False (its cached flag says so)"


def pinned_reason(model: nn.Module, *, calls_when_lifted: bool | None = None) -> str:
    """Why transformers keeps ``model`` on eager attention, with the way out; ``""`` when it does not."""
    classes = pinned_classes(model)
    if not classes:
        return ""
    cls = classes[0]
    text = (
        f"transformers pins {cls.__name__} to its eager attention: {_why(cls)}; so `set_attn_implementation` leaves "
        "it on eager (with a logged warning) and headlab cannot route its attention through the attention interface"
    )
    lift = (
        f"set `{cls.__name__}._can_set_attn_implementation = classmethod(lambda cls: True)` before loading or "
        f"adapting it, or in its modelling file reach the attention function through "
        f"`{_LOOKED_FOR}config._attn_implementation, eager_attention_forward)`"
    )
    if calls_when_lifted:
        return f"{text}; its modules do call the interface once that pin is lifted: {lift} (headlab then checks it)"
    if calls_when_lifted is False:
        return (
            f"{text}; with the pin lifted its modules still call no attention function (they compute attention "
            "themselves), so a family class with its own attention forward is needed"
        )
    return f"{text}; if its modules call the interface, {lift}"


@contextlib.contextmanager
def lifted(classes: list[type]) -> Iterator[None]:
    """transformers' pin lifted for ``classes`` during the block (their cached answer set True, restored after)."""
    saved = [(c, c.__dict__.get("_can_set_attn_implementation_cached_value", _MISSING)) for c in classes]
    for c in classes:
        c._can_set_attn_implementation_cached_value = True  # type: ignore[attr-defined]  # transformers' own cache
    try:
        yield
    finally:
        for c, v in saved:
            if v is _MISSING:
                delattr(c, "_can_set_attn_implementation_cached_value")
            else:
                c._can_set_attn_implementation_cached_value = v  # type: ignore[attr-defined]


_MISSING = object()

__all__ = ["lifted", "pinned_classes", "pinned_reason"]


def no_calls_reason(model: nn.Module, x: dict, own: str | None = None) -> str:
    """Why no module of ``model`` was seen calling the attention interface: transformers' pin to eager when, traced
    once more with the pin lifted, its modules do call it; else ``own`` (default: that its modules compute attention
    in their own way, which headlab has no seam for)."""
    from headlab.models.hf.trace import trace

    own = own or (
        "none of its modules calls transformers' attention interface (it computes attention in its own modules, "
        "as MPT's ALiBi or RoFormer do), so headlab's backends, gates and captures have no seam to serve; a family "
        "class with its own attention forward is needed"
    )
    classes = pinned_classes(model)
    if not classes:
        return own
    try:
        with lifted(classes):
            calls = trace(model, x)
    except Exception:  # noqa: BLE001  (the model does not run unpinned: its own math is the reason)
        calls = []
    if calls:
        return pinned_reason(model, calls_when_lifted=True)
    return (
        f"{own} (transformers also pins {classes[0].__name__} to eager; with that pin lifted no module calls it either)"
    )
