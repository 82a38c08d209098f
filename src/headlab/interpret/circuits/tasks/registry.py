"""The tasks by name: :data:`TASKS` and :func:`task`."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from headlab.errors import ConfigError
from headlab.interpret.circuits.tasks.base import TaskPairs
from headlab.interpret.circuits.tasks.greater_than import greater_than
from headlab.interpret.circuits.tasks.induction import induction
from headlab.interpret.circuits.tasks.ioi import ioi
from headlab.interpret.circuits.tasks.retrieval import retrieval

TASKS: dict[str, Callable[..., TaskPairs]] = {
    "ioi": ioi,
    "greater-than": greater_than,
    "induction": induction,
    "retrieval": retrieval,
}


def task(name: str, model, n: int = 64, *, seed: int = 0, **kw) -> TaskPairs:
    """The pairs of the task ``name`` (a key of :data:`TASKS`); ``kw`` goes to its builder (``half=``,
    ``vocab=`` for induction, ``templates=`` for IOI).

        >>> task("copying", None)
        Traceback (most recent call last):
        ...
        headlab.errors.ConfigError: unknown task 'copying'; the tasks are: ioi, greater-than, induction, retrieval
    """
    build = TASKS.get(name) if isinstance(name, str) else None
    if build is None:
        raise ConfigError(f"unknown task {name!r}; the tasks are: {', '.join(TASKS)}")
    takes = [p for p in inspect.signature(build).parameters if p not in ("model", "n", "seed")]
    bad = [k for k in kw if k not in takes]
    if bad:
        raise ConfigError(f"the {name} task takes no option {bad[0]!r}; its options are: {', '.join(takes) or 'none'}")
    return build(model, n, seed=seed, **kw)
