"""What a report section is: data in (the job and the one recording), a result object out, a part of the page.

``headlab analyze`` runs the model once. Before the run it asks every active section which capture
sites it needs (:meth:`Section.sites`, and :meth:`Section.stats` for the map-free statistics) and
records them all in one :func:`headlab.capture`; then each section, in registration order, computes
its result from that recording (and from the results of the sections before it), writes its files
beside the page, and gives its part of the page (:class:`PagePart`): HTML for the page's sections
slot, data for the page's script, notes for the banner and ``heads.json``.

A section is a :class:`~headlab.interpret.study.base.Part`, as every instrument is: a registered,
named piece of analysis that declares its sites and statistics before the one recording. A section's
context is the analyze :class:`Job`; an instrument's is the study runner's ``Context``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from headlab.interpret.heads.labels import LabelThresholds
from headlab.interpret.study.base import Part
from headlab.registry import Registry


@dataclass
class Job:
    """One ``analyze`` call, prepared: the model, the input, the mode and what the user asked for."""

    loaded: Any  # a LoadedModel
    text: str
    inputs: dict  # the encoded input (batch 1)
    tokens: list[str]
    causal: bool
    separators: list[int] | None  # [SEP] positions of an encoder; None for decoders
    mode: str  # "full" (every map captured and drawn) or "streaming" (statistics; chosen heads drawn)
    max_full_tokens: int
    out: Path
    backend: str | None = None
    chosen: list[tuple[int, int]] | None = None  # heads the user asked to draw
    thresholds: LabelThresholds = field(default_factory=LabelThresholds)
    annotations: Mapping[tuple[int, int], str | Sequence[str]] | None = None
    write_flow: bool = False  # analyze --flow: the norm maps and the rollout as files too
    say: Callable[[str], None] = lambda _m: None

    @property
    def adapter(self):
        return self.loaded.adapter

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def sinks(self) -> list[int]:
        """The positions whose received mass the table reports: the first token and each [SEP]."""
        return [0] + (self.separators or [])


@dataclass
class PagePart:
    """A section's share of the page."""

    html: str = ""  # trusted HTML for the page's sections slot (built from escaped text)
    data: dict = field(default_factory=dict)  # {key: JSON-able} for the page's script
    notes: list[str] = field(default_factory=list)  # for the banner and heads.json


class Section(Part):
    """One part of the report. Subclasses set ``name`` and implement :meth:`compute`.

    From :class:`~headlab.interpret.study.base.Part`: :meth:`active`, :meth:`sites` (capture sites the one
    recording must hold) and :meth:`stats` (map-free statistics read from the ``stats`` sites), each given the
    :class:`Job`."""

    name: ClassVar[str]

    def compute(self, job: Job, cache, results: dict[str, object]) -> object:
        """This section's result from the recording (``cache``, an :class:`~headlab.interpret.capture.ActivationCache`)
        and the results of the sections before it (by name)."""
        raise NotImplementedError

    def write(self, job: Job, result, results: Mapping[str, object]) -> list[str]:
        """Write this section's files beside the page; returns notes."""
        return []

    def page(self, job: Job, result, results: Mapping[str, object]) -> PagePart:
        """This section's part of the page."""
        return PagePart()


_REGISTRY: Registry[Section] = Registry("a report section", "its results and data are keyed by it")
_SECTIONS: list[Section] = _REGISTRY.items  # the registry's own list, in page order


def register(cls: type[Section]) -> type[Section]:
    """Class decorator: add a section to the report (pages show sections in registration order)."""
    return _REGISTRY.register(cls)


def registered() -> list[Section]:
    """The report's sections, in page order."""
    return _REGISTRY.registered()


__all__ = ["Job", "PagePart", "Section", "register", "registered"]
