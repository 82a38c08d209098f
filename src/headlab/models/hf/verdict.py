"""The report of the load-time check (:func:`headlab.models.hf.verify.verify`): one :class:`Check` per check and
the :class:`Verdict` of a model, which says which check failed and what to declare (:meth:`Verdict.refusal`) and is
saved in headlab's envelope (kind ``load_check``).
"""

from __future__ import annotations

from dataclasses import InitVar, asdict, dataclass, field

from headlab.results import envelope


@dataclass
class Check:
    """One check: its name, whether it held, the worst difference seen against its tolerance, and a detail."""

    name: str
    passed: bool
    worst: float = 0.0
    tol: float = 0.0
    detail: str = ""


@dataclass
class Verdict:
    """The checks of one model (:func:`~headlab.models.hf.verify.verify`).

    ``headlab`` takes the envelope's header of a saved verdict (and drops it), so that
    ``Verdict(**verdict.to_json())`` reads one back as it did before the header; :meth:`from_json` also
    rebuilds the checks."""

    model_type: str
    family: str
    by_structure: bool
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    cached: bool = False
    headlab: InitVar[dict | None] = None  # a saved verdict's header: accepted, not kept (the fields say it all)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> Check | None:
        return next((c for c in self.checks if not c.passed), None)

    def refusal(self) -> str:
        """One line: which check failed, by how much, and what to declare."""
        from headlab.models.hf.registry import ADDING_A_FAMILY, BY_STRUCTURE

        c = self.failed
        assert c is not None  # said only of a verdict that failed
        near = BY_STRUCTURE["nearest"](self.model_type) if "nearest" in BY_STRUCTURE else None
        hint = f"; its structure is nearest the {near!r} family, whose class shows what to declare" if near else ""
        return (
            f"no headlab adapter for {self.model_type!r}: adapted by structure, it failed the load-time check "
            f"{c.name!r} ({c.detail}; worst difference {c.worst:.3g}, tolerance {c.tol:.0e}), so headlab will not "
            f"serve numbers it cannot vouch for{hint}; declare the layout in a family class ({ADDING_A_FAMILY})"
        )

    def to_json(self) -> dict:
        """The verdict in headlab's envelope (kind ``load_check``, model: the model type) beside its fields."""
        return envelope(
            "load_check",
            asdict(self),
            model=self.model_type,
            settings={"family": self.family, "by_structure": self.by_structure},
        )

    @classmethod
    def from_json(cls, d: dict) -> Verdict:
        """A verdict from :meth:`to_json` (or a file of an earlier version, without the header), checks included."""
        fields = {k: v for k, v in d.items() if k not in ("headlab", "checks")}
        return cls(**fields, checks=[Check(**c) for c in d.get("checks", [])])


__all__ = ["Check", "Verdict"]
