"""The result of :func:`~headlab.interpret.circuits.selfrepair.self_repair` and how a head is judged: the verdicts'
thresholds (:class:`Rules`), :func:`judge`, one head's numbers (:class:`HeadRepair`) and the whole measurement
(:class:`SelfRepair`: its table, and its file through :mod:`headlab.results`). The effects themselves (``total``,
``direct``, ``self_repair``, ``comp(h, k)``, ``pair``) are defined in :mod:`headlab.interpret.circuits.selfrepair`;
every one is a change ``m_ablated - m_clean`` of the metric's mean over examples.

**Verdicts** (they extend :mod:`headlab.interpret.heads.ablation`'s unused / redundant / unique to the direct path);
``t = rules.tol * |m(corrupted) - m(clean)|`` and the first rule that holds is the verdict:

==============  ===================================================================================================
unused          ``|direct| < t`` and ``|total| < t``: ablating h moves the metric by less than ``tol`` of the gap
                either way
irreplaceable   ``|direct| < t <= |total|`` (h acts through the components downstream, not its direct path), or
                ``|total| > (1 - rules.repaired) |direct|``: the total effect keeps more than half (by default) of
                the direct effect's size (less than ``repaired`` of it undone, or an over-correction by more than
                ``1 - repaired`` in the other direction)
duplicated      ``|total| <= rules.alone * |direct|`` (alone it moves little), and ``|pair| - max(|total|,
                |partner_alone|) >= rules.joint * |direct|``: ablated with its strongest compensator k* it moves
                much more than either alone (k* is named)
compensated     ``|total| <= (1 - rules.repaired) |direct|`` otherwise: downstream components undo most of the
                direct effect (``undone`` within ``1 +/- (1 - repaired)``; the top compensators are named)
unmeasured      interrupted before this head was measured
==============  ===================================================================================================
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import headlab.checks as checks
from headlab.errors import InputError
from headlab.interpret.circuits.graph import head as head_name
from headlab.results import Result

KIND = "circuit_self_repair"
VERDICTS = ("irreplaceable", "compensated", "duplicated", "unused", "unmeasured")


@dataclass(frozen=True)
class Rules:
    """The thresholds of the verdicts (module docstring); each a fraction."""

    tol: float = 0.05  # "moves the metric": at least this fraction of the clean-corrupted gap (below it: unused)
    repaired: float = 0.5  # compensated / duplicated: |total| <= (1 - repaired) |direct| (most of it undone)
    alone: float = 0.25  # duplicated: ablated alone, h moves at most this fraction of its direct effect ...
    joint: float = 0.5  # ... and with its strongest compensator at least this fraction of it more than either alone
    top: int = 3  # compensators named per head

    def __post_init__(self) -> None:
        for name in ("tol", "repaired", "alone", "joint"):
            checks.at_least(f"Rules.{name}", getattr(self, name), 0, what=f" (a fraction, e.g. {getattr(Rules, name)})")
        checks.positive_int("Rules.top (compensators named per head)", self.top)

    def text(self) -> list[str]:
        """The rules in words, with this object's numbers (stored with every result)."""
        keep = 1 - self.repaired
        return [
            f"t = {self.tol:g} x |gap|; effects are m_ablated - m_clean; undone = (direct - total) / direct",
            "unused: |direct| < t and |total| < t",
            f"irreplaceable: |direct| < t <= |total|, or |total| > {keep:g} |direct|",
            f"duplicated: |total| <= {self.alone:g} |direct| and |pair(h, k*)| - max(|total|, |k* alone|) >= "
            f"{self.joint:g} |direct|",
            f"compensated: |total| <= {keep:g} |direct| otherwise",
        ]


def judge(
    total: float,
    direct: float,
    gap: float,
    rules: Rules = Rules(),
    *,
    partner: str | None = None,
    pair: float = math.nan,
    partner_alone: float = math.nan,
    by: Sequence[str] = (),
) -> tuple[str, str]:
    """``(verdict, evidence)`` of one head from its measured effects (the rules of the module docstring); ``by``
    names the top compensators in a "compensated" verdict's evidence. A value that is exactly 0 counts as below
    the tolerance, even when ``rules.tol`` is 0.

    >>> judge(-0.1, -3.0, -4.0)[0], judge(-2.5, -3.0, -4.0)[0], judge(-1.0, -3.0, -4.0)[0]
    ('compensated', 'irreplaceable', 'compensated')
    >>> judge(0.0, -3.0, -4.0, partner="a2.h1", pair=-3.0, partner_alone=0.0)
    ('duplicated', 'alone 0 of direct -3; with a2.h1 -3 (a2.h1 alone 0)')
    """
    if any(math.isnan(x) for x in (total, direct)):
        return "unmeasured", "not measured (interrupted)"
    t = rules.tol * abs(gap)

    def small(x: float) -> bool:
        return abs(x) < t or x == 0

    if small(direct) and small(total):
        return "unused", (
            f"|direct| {abs(direct):.3g} and |total| {abs(total):.3g} below {t:.3g} ({rules.tol:g} of the gap)"
        )
    if small(direct):
        return "irreplaceable", (
            f"acts through downstream components: total {total:.3g}, direct {direct:.3g} below {t:.3g}"
        )
    undone = (direct - total) / direct
    if abs(total) > (1 - rules.repaired) * abs(direct):
        if undone > 1:
            return "irreplaceable", (
                f"total {total:.3g} against direct {direct:.3g}: downstream components "
                f"over-correct ({undone:.0%} undone), acting beyond its direct path"
            )
        return "irreplaceable", f"total {total:.3g} keeps {1 - undone:.0%} of direct {direct:.3g}"
    if (
        partner is not None
        and abs(total) <= rules.alone * abs(direct)
        and not math.isnan(pair)
        and not math.isnan(partner_alone)
        and abs(pair) - max(abs(total), abs(partner_alone)) >= rules.joint * abs(direct)
    ):
        return "duplicated", (
            f"alone {total:.3g} of direct {direct:.3g}; with {partner} {pair:.3g} ({partner} alone {partner_alone:.3g})"
        )
    names = f" by {', '.join(by)}" if by else ""
    return "compensated", f"{undone:.0%} of direct {direct:.3g} undone{names} (total {total:.3g})"


def compensators(compensation: dict[str, float], direct: float) -> list[tuple[str, float]]:
    """The components whose compensation undoes some of the direct effect (pushes the metric against it: up when
    ``direct < 0``), strongest first.

    >>> compensators({"a1.h0": 2.0, "a1.h1": -1.0, "m1": 0.5}, -3.0)
    [('a1.h0', 2.0), ('m1', 0.5)]
    """
    sign = 1.0 if direct <= 0 else -1.0
    return sorted(((k, v) for k, v in compensation.items() if sign * v > 0), key=lambda kv: -sign * kv[1])


@dataclass
class HeadRepair:
    """One head's effects (``m_ablated - m_clean``, the metric's mean over examples) and verdict.

    ``compensation`` maps every downstream component (``"a2.h1"``, ``"m1"``) to ``comp(h, k)``; ``partner`` is the
    strongest compensator (None: none undoes any of the direct effect), ``pair`` the effect of ablating h with it,
    ``partner_alone`` of ablating it alone."""

    head: str
    total: float
    direct: float
    self_repair: float
    compensation: dict[str, float]
    partner: str | None
    pair: float
    partner_alone: float
    verdict: str
    evidence: str
    n_top: int = 3

    @property
    def undone(self) -> float:
        """The fraction of the direct effect that downstream components undo: ``self_repair / -direct``."""
        return -self.self_repair / self.direct if self.direct else math.nan

    @property
    def other(self) -> float:
        """``self_repair - sum(compensation)``: the final norm's rescaling and the edges' non-additivity through it."""
        return self.self_repair - sum(self.compensation.values())

    @property
    def top(self) -> list[tuple[str, float]]:
        """The components that undo most of the direct effect, strongest first: ``[(name, comp), ...]``."""
        return compensators(self.compensation, self.direct)[: self.n_top]


@dataclass
class SelfRepair:
    """Self-repair of a list of heads (the effects defined in :mod:`headlab.interpret.circuits.selfrepair`, the
    verdicts in this module's docstring): per head total, direct, self-repair, the top compensating components and
    a verdict; ``rules`` says how the verdicts were reached."""

    model: str
    metric: str
    ablation: str
    n_examples: int
    clean: float
    corrupted: float
    heads: list[HeadRepair]
    rules: Rules = field(default_factory=Rules)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    kind = KIND

    @property
    def gap(self) -> float:
        return self.corrupted - self.clean

    def __getitem__(self, head: str | tuple[int, int]) -> HeadRepair:
        name = head if isinstance(head, str) else head_name(*head)
        for h in self.heads:
            if h.head == name:
                return h
        raise KeyError(f"{name!r} was not measured; heads: {', '.join(h.head for h in self.heads)}")

    @property
    def backups(self) -> dict[str, list[str]]:
        """``{head: [its top compensators]}``: Wang et al.'s backup heads (and MLPs) of each head."""
        return {h.head: [k for k, _ in h.top] for h in self.heads}

    def counts(self) -> dict[str, int]:
        out = {v: 0 for v in VERDICTS}
        for h in self.heads:
            out[h.verdict] += 1
        return out

    def table(self, digits: int = 3) -> str:
        """A plain-text table for the terminal: one row per head, then the rules."""

        def f(x: float) -> str:
            return "nan" if math.isnan(x) else f"{x:.{digits}g}"

        head = ["head", "total", "direct", "self-repair", "undone", "other", "top compensators", "verdict"]
        rows = [head]
        t = self.rules.tol * abs(self.gap)
        for h in self.heads:
            top = ", ".join(f"{k} {f(v)}" for k, v in h.top) or "-"
            verdict = h.verdict + (f" (with {h.partner})" if h.verdict == "duplicated" else "")
            undone = "-" if math.isnan(h.undone) or abs(h.direct) < t else f"{h.undone:.0%}"  # 0/0-like below t
            rows.append([h.head, f(h.total), f(h.direct), f(h.self_repair), undone, f(h.other), top, verdict])
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = [
            f"self-repair: {self.model}, metric {self.metric}, ablation {self.ablation}, {self.n_examples} "
            f"examples; clean {f(self.clean)}, corrupted {f(self.corrupted)}; effects are m_ablated - m_clean"
        ]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines += ["rules: " + "; ".join(self.rules.text())] + [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_result(self) -> Result:
        def num(x: float):
            return None if math.isnan(x) else x

        settings = {"metric": self.metric, "ablation": self.ablation, "rules": asdict(self.rules)}
        figures = {
            "n_examples": self.n_examples,
            "clean": self.clean,
            "corrupted": self.corrupted,
            "heads": [
                {
                    "head": h.head,
                    "total": num(h.total),
                    "direct": num(h.direct),
                    "self_repair": num(h.self_repair),
                    "undone": num(h.undone),
                    "other": num(h.other),
                    "compensation": {k: num(v) for k, v in h.compensation.items()},
                    "top": [[k, v] for k, v in h.top],
                    "partner": h.partner,
                    "pair": num(h.pair),
                    "partner_alone": num(h.partner_alone),
                    "verdict": h.verdict,
                    "evidence": h.evidence,
                }
                for h in self.heads
            ],
            "counts": self.counts(),
            "rules": self.rules.text(),
            "seconds": self.seconds,
            "notes": self.notes,
        }
        return Result(self.kind, model=self.model, settings=settings, figures=figures)

    def save(self, path: str | os.PathLike):
        return self.to_result().save(path)

    @classmethod
    def from_result(cls, r: Result) -> SelfRepair:
        if r.kind != cls.kind:
            raise InputError(
                f"this file holds a {r.kind!r} result, not self-repair ({cls.kind}); give a file that "
                "SelfRepair.save wrote"
            )

        def num(x) -> float:
            return math.nan if x is None else float(x)

        try:
            f, s = r.figures, r.settings
            rules = Rules(**s.get("rules", {}))
            heads = [
                HeadRepair(
                    h["head"],
                    num(h["total"]),
                    num(h["direct"]),
                    num(h["self_repair"]),
                    {k: num(v) for k, v in h["compensation"].items()},
                    h.get("partner"),
                    num(h.get("pair")),
                    num(h.get("partner_alone")),
                    h["verdict"],
                    h.get("evidence", ""),
                    rules.top,
                )
                for h in f["heads"]
            ]
            return cls(
                model=r.model or "",
                metric=s.get("metric", ""),
                ablation=s.get("ablation", ""),
                n_examples=int(f["n_examples"]),
                clean=float(f["clean"]),
                corrupted=float(f["corrupted"]),
                heads=heads,
                rules=rules,
                seconds=float(f.get("seconds", 0.0)),
                notes=list(f.get("notes", [])),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(
                f"not a complete self-repair result ({type(e).__name__}: {e}); give a file that SelfRepair.save wrote"
            ) from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> SelfRepair:
        return cls.from_result(Result.load(path, what="a self-repair file headlab wrote (SelfRepair.save)"))

    def __repr__(self) -> str:
        verdicts = ", ".join(f"{h.head} {h.verdict}" for h in self.heads[:6])
        more = f", ... ({len(self.heads)} heads)" if len(self.heads) > 6 else ""
        return f"SelfRepair({self.model}, {self.ablation} ablation: {verdicts}{more})"


__all__ = ["HeadRepair", "KIND", "Rules", "SelfRepair", "VERDICTS", "compensators", "judge"]
