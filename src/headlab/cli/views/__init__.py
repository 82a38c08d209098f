"""Showing a result on the terminal: the command line's views, apart from the instruments that compute.

An instrument computes and returns a :class:`~headlab.results.Result`; how its command shows it (tables, trees,
the "wrote ..." lines) is a *view*, a function ``show(ctx, outcome, console, err)`` registered under the
instrument's name with :func:`view` (``console``: stdout, ``err``: stderr, rich consoles). Each shipped instrument
has its view in one module of this package; :func:`render` imports them when a command has a result to show, so
``headlab --help`` imports none.

An instrument of your own (a plug-in, below this layer) may register a view here, or define
``render(ctx, outcome, console, err)`` itself; with neither, the result envelope's figures are printed.

    >>> from rich.console import Console
    >>> from headlab.interpret.study.base import Outcome
    >>> from headlab.results import Result
    >>> render(None, Outcome(Result("lengths", figures={"words": [2, 3]})), Console(), Console(stderr=True))
    {'words': [2, 3]}
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

from headlab.registry import Registry

Show = Callable  # show(ctx, outcome, console, err) -> None


@dataclass(frozen=True)
class View:
    """The view of the instrument ``name``: ``show(ctx, outcome, console, err)``."""

    name: str
    show: Show


_VIEWS: Registry[View] = Registry("a view", "it is the name of the instrument it shows", instances=False)
_loaded: list[bool] = []


def view(name: str) -> Callable[[Show], Show]:
    """Decorator: ``show`` is how the command of instrument ``name`` shows its result."""

    def register(show: Show) -> Show:
        _VIEWS.register(View(name, show))
        return show

    return register


def _load_shipped() -> None:
    if not _loaded:  # every module of this package is one instrument's view: importing it registers it
        _loaded.append(True)
        for m in pkgutil.iter_modules(__path__):
            import_module(f"{__name__}.{m.name}")


def find(name: str) -> Show | None:
    """The view registered for the instrument ``name`` (the shipped ones are imported first), or None."""
    _load_shipped()
    found = _VIEWS.find(name)
    return None if found is None else found.show


def render(ctx, outcome, console, err) -> None:
    """Show ``outcome`` (a run of ``ctx.instrument``): its view, else the instrument's own ``render``, else the
    envelope's figures."""
    inst = None if ctx is None else ctx.instrument
    show = None if inst is None else find(inst.name) or getattr(inst, "render", None)
    if show is not None:
        show(ctx, outcome, console, err)
    elif outcome.result is not None:
        console.print(outcome.result.figures, highlight=False, soft_wrap=True)


__all__ = ["View", "find", "render", "view"]
