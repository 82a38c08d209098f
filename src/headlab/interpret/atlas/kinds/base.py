"""An atlas kind as one record: its name, its role, its threshold, its score, its causal task and its look.

:data:`KINDS` holds every registered :class:`Kind`, in page order (the order of registration); every part
of the atlas asks the record and holds no table of its own: the run scores a kind with ``Kind.score``,
the checks gate its top heads on ``Kind.task``, the result compares its scores with ``Kind.threshold``,
the pages colour and letter it. Adding a kind is one module that builds its record and calls
:func:`register` (``kinds/induction.py`` is a short one to copy), imported from ``kinds/__init__.py``
when it is built in.

A score reads the :class:`Run`: the model, the inputs the atlas built and the sizes it was given, and
returns an ``(n_layers, H)`` float64 grid (NaN where a pruned layer has fewer heads). Kinds that read
the same input share one recording of it (``Kind.reads``; :mod:`.shared`), and kinds with the same task
share its data and its ungated run (``Task.name``).

    >>> import torch
    >>> toy = Kind(name="toy", role="toy", threshold=0.5, reads="repeated", letter="T", colour="#000",
    ...            definition="a constant", score=lambda run: torch.full((1, 2), 0.5, dtype=torch.float64))
    >>> _ = register(toy)
    >>> KINDS["toy"].role, ROLE["toy"], list(KINDS)[-1]
    ('toy', 'toy', 'toy')
    >>> unregister("toy") is toy, "toy" in KINDS
    (True, False)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import headlab.checks as checks
from headlab.errors import ConfigError
from headlab.registry import Registry


@dataclass(frozen=True)
class Measure:
    """What a causal task measures, ready to run on configurations of gated heads."""

    values: Callable[[torch.Tensor], torch.Tensor]  # configs (C, n_layers, H) bool -> (C, N) metric per example
    task: str  # the task in words, as each verdict records it
    harm: int  # +1: a larger metric is worse (a loss); -1: a smaller one is (an accuracy)
    extra: dict = field(default_factory=dict)  # more fields for each verdict of the task


@dataclass(frozen=True)
class Task:
    """A causal check's task. Kinds with the same task share its data and one ungated run."""

    name: str  # the group's name: its progress stage and its unit of the atlas ("check repeated", ...)
    summary: str  # the task in a few words
    prepare: Callable[[Run, Any, int], Measure | str]  # (run, the atlas so far, k) -> a Measure, or why not run
    no_lm: str | None = None  # why it needs a language-model head (None: it runs without one)
    validate: Callable[[Run], None] | None = None  # refuses sizes the check cannot use, before any work


def _available(run: Run) -> str | None:
    return None


@dataclass(frozen=True)
class Kind:
    """One head type of the literature: how it is scored, when a head carries it, how it is checked and drawn."""

    name: str  # the key of its scores, threshold and verdict, and what `kinds=` / --kinds name
    role: str  # what a head at or above the threshold is called on every page
    threshold: float  # the score from which a head carries the role
    score: Callable[[Run], torch.Tensor]  # the run -> (n_layers, H) float64, NaN where a layer has no such head
    reads: str  # its input: "repeated" (random tokens repeated once), "text", "needles", "treebank", or its own
    definition: str  # the score in one line, with its paper: the report's and the docs' words
    letter: str  # its letter in the atlas page's role grid
    colour: str  # its colour there and in the legend (CSS)
    task: Task | None = None  # the causal check's task; None: scored, never checked
    unavailable: Callable[[Run], str | None] = _available  # why this model or these inputs cannot score it


def _taken(kind: Kind, names: list[str]) -> ConfigError:
    return ConfigError(f"an atlas kind named {kind.name!r} is already registered; unregister({kind.name!r}) first")


def _unknown(name: str, names: list[str]) -> ConfigError:
    return ConfigError(f"no atlas kind {name!r} is registered; the kinds: {', '.join(names)}")


_KINDS: Registry[Kind] = Registry(
    "an atlas kind", "its scores are keyed by it", instances=False, taken=_taken, unknown=_unknown, strict=True
)
KINDS: Mapping[str, Kind] = _KINDS.table  # every registered kind by name, in page order (live)


def register(kind: Kind) -> Kind:
    """Add ``kind`` to :data:`KINDS` (at the end of the page) and return it."""
    if not isinstance(kind, Kind):
        raise ConfigError(f"register() takes a Kind record, got {type(kind).__name__}")
    if not kind.name.isidentifier():
        raise ConfigError(f"an atlas kind's name is its key in scores and JSON: a Python identifier, got {kind.name!r}")
    if kind.name in KINDS:
        raise _taken(kind, [kind.name])
    checks.finite_float(f"kind {kind.name!r}: the threshold", kind.threshold)
    if len(kind.letter) != 1 or not callable(kind.score):
        raise ConfigError(f"kind {kind.name!r}: give one letter for the role grid and a callable score(run)")
    return _KINDS.register(kind)


def unregister(name: str) -> Kind:
    """Remove the kind ``name`` from :data:`KINDS` and return its record."""
    kind = _KINDS.unregister(name)
    assert kind is not None  # a strict registry raises for an unknown name
    return kind


class _Roles(Mapping):
    """``{kind: role}``, read from :data:`KINDS` at each lookup."""

    def __getitem__(self, name: str) -> str:
        return KINDS[name].role

    def __iter__(self) -> Iterator[str]:
        return iter(KINDS)

    def __len__(self) -> int:
        return len(KINDS)


ROLE: Mapping[str, str] = _Roles()


@dataclass
class Run:
    """What a score or a task reads: the model, the atlas's inputs and sizes, and where it leaves its extras.

    ``repeated_ids`` ``(n, P + 2 half + S)`` with ``start = P`` (:func:`.tasks.repeated`); ``pieces`` the
    natural-text pieces (:func:`.tasks.natural`); ``sizes`` the atlas's arguments (``half``, ``window``,
    ``n_repeated``, ``needle_trials``, ``seed``, ...). A score adds to ``settings``, ``notes`` and ``syntactic``
    (they go into the :class:`~headlab.interpret.atlas.result.Atlas`) and leaves what its task needs in ``state``;
    all of it is kept with the score's phase (a unit of the run) as JSON (:mod:`headlab.interpret.atlas.codec`: tensors, numbers,
    strings, lists, dicts), so that a resumed run's check reads the same ``state``."""

    adapter: Any
    loaded: Any  # the LoadedModel (tokenizer, name, max_positions), or None for a bare module
    tokenizer: Any
    has_logits: bool  # a decoder with a language-model head
    treebank: Any
    texts: Any
    sizes: dict
    vocab: int
    max_rows: int
    say: Callable[[str, int, int], None]
    repeated_ids: torch.Tensor | None = None
    start: int = 0
    pieces: list = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    syntactic: dict[str, list[str]] = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        return next(self.adapter.model.parameters()).device

    def memo(self, key: str, build: Callable[[], Any]) -> Any:
        """``build()``, once per run: a recording several kinds read."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def forget(self) -> None:
        """Drop the recordings :meth:`memo` holds (once every kind is scored)."""
        self._memo.clear()

    def grid(self, fill: float = math.nan) -> torch.Tensor:
        """A ``(n_layers, H)`` float64 grid of ``fill``."""
        return torch.full((self.adapter.n_layers, self.adapter.n_heads), fill, dtype=torch.float64)

    def mask_missing(self, grid: torch.Tensor) -> torch.Tensor:
        """``grid`` with NaN at the heads a pruned layer no longer has."""
        out = grid.clone()
        for layer, n in enumerate(self.adapter.layer_heads):
            out[layer, n:] = float("nan")
        return out


__all__ = ["KINDS", "ROLE", "Kind", "Measure", "Run", "Task", "register", "unregister"]
