"""The atlas as data: :class:`Atlas`, every head's scores, roles and the causal verdicts, to and from JSON.

Grids are ``(n_layers, H)`` tensors, H the query heads (NaN where a pruned layer has fewer);
``kv_group[l, h]`` is the key/value head query head h reads (``h // (H // Hkv)``), so a GQA model's
heads that share their keys and values can be read off together.

    >>> import torch
    >>> a = Atlas(model="m", family="headlab", causal=True, n_layers=1, n_heads=2, n_kv_heads=1,
    ...           kv_group=torch.zeros(1, 2, dtype=torch.long),
    ...           scores={"induction": torch.tensor([[0.9, 0.1]])}, thresholds={"induction": 0.3})
    >>> a.heads_of("induction"), a.roles(0, 0)
    ([(0, 0)], ['induction'])
    >>> torch.allclose(Atlas.from_json(a.to_json()).scores["induction"], a.scores["induction"].double())
    True
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from headlab.errors import ConfigError, InputError
from headlab.interpret.atlas.kinds import KINDS, ROLE
from headlab.results import envelope


class Thresholds:
    """The score from which a head carries each kind's role (the causal check tests the top k regardless):
    the kind's own (``Kind.threshold``, in its module under ``kinds/``) unless given here. Frozen.

        >>> t = Thresholds(induction=0.5)
        >>> t.induction, t.previous_token, t.as_dict()["sink"]
        (0.5, 0.4, 0.5)
    """

    __slots__ = ("_given",)
    _given: dict[str, float]

    def __init__(self, **given: float) -> None:
        bad = [k for k in given if k not in KINDS]
        if bad:
            raise ConfigError(
                f"no atlas kind {', '.join(map(repr, bad))} to set a threshold for; the kinds: {', '.join(KINDS)}"
            )
        object.__setattr__(self, "_given", {k: float(v) for k, v in given.items()})

    def __getattr__(self, name: str) -> float:
        if not name.startswith("_") and name in KINDS:
            return self._given.get(name, KINDS[name].threshold)
        raise AttributeError(f"no atlas kind {name!r}; the kinds: {', '.join(KINDS)}")

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"Thresholds are frozen; build new ones: Thresholds({name}={value!r})")

    def __reduce__(self):
        return (_thresholds, (dict(self._given),))

    def __eq__(self, other) -> bool:
        return isinstance(other, Thresholds) and self._given == other._given

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._given.items())))

    def __repr__(self) -> str:
        return f"Thresholds({', '.join(f'{k}={v!r}' for k, v in self._given.items())})"

    def as_dict(self) -> dict[str, float]:
        """``{kind: threshold}`` for every registered kind, in page order."""
        return {k: self._given.get(k, kd.threshold) for k, kd in KINDS.items()}


def _thresholds(given: dict) -> Thresholds:
    return Thresholds(**given)


def _grid(t) -> list:
    a = np.asarray(t.detach().cpu().double() if isinstance(t, torch.Tensor) else t, dtype=np.float64)
    return np.where(np.isnan(a), None, np.round(a, 6)).tolist()  # type: ignore[call-overload]  # numpy's stubs take no None; an object array is meant


def _ungrid(rows) -> torch.Tensor:
    return torch.tensor([[float("nan") if x is None else float(x) for x in r] for r in rows], dtype=torch.float64)


@dataclass
class Atlas:
    """Every head of one model, scored on every kind, with the causal checks of the kinds that have a task.

    Attributes:
        scores: ``{kind: (n_layers, H) tensor}`` for every scored kind, plus ``"copying"`` (the OV
            circuit's eigenvalue positivity, beside induction).
        thresholds: ``{kind: value}``: a head at or above carries the kind's role.
        labels: ``labels[l][h]``: the pattern labels of :mod:`headlab.interpret.heads.labels` on real text.
        syntactic: ``{"l.h": ["det dep->head 94% (baseline 52%)", ...]}`` from the probe, when a treebank was given.
        verdicts: ``{kind: {...}}``: the causal check (:func:`headlab.interpret.atlas.causal.verdict`'s
            numbers, plus the task, the top-k heads, the random draws and the per-example effects).
        skipped: ``{kind: reason}`` for kinds not scored, ``{"kind check": reason}`` for checks not run.
        settings: the sizes and seeds that reproduce the run; seconds: per phase.
        evidence: ``{"kind:l.h": {"tokens", "map"}}``: each kind's top heads' attention on one short input.
    """

    model: str
    family: str
    causal: bool
    n_layers: int
    n_heads: int
    n_kv_heads: int
    kv_group: torch.Tensor
    scores: dict[str, torch.Tensor]
    thresholds: dict[str, float]
    labels: list[list[list[str]]] = field(default_factory=list)
    syntactic: dict[str, list[str]] = field(default_factory=dict)
    verdicts: dict[str, dict] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    evidence: dict[str, dict] = field(default_factory=dict)

    @property
    def kinds(self) -> list[str]:
        """The kinds scored, in :data:`KINDS` order."""
        return [k for k in KINDS if k in self.scores]

    def heads_of(self, kind: str) -> list[tuple[int, int]]:
        """Heads at or above the kind's threshold, highest score first."""
        s = self.scores[kind]
        thr = self.thresholds.get(kind, math.inf)
        idx = [(l, h) for l in range(s.shape[0]) for h in range(s.shape[1]) if float(s[l, h]) >= thr]
        return sorted(idx, key=lambda x: -float(s[x]))

    def top(self, kind: str, k: int) -> list[tuple[int, int]]:
        """The ``k`` highest-scoring heads of a kind (NaN last)."""
        s = torch.nan_to_num(self.scores[kind].double(), nan=-math.inf).flatten()
        order = torch.argsort(s, descending=True, stable=True)[:k]
        return [(int(i) // self.n_heads, int(i) % self.n_heads) for i in order]

    def roles(self, layer: int, head: int) -> list[str]:
        """Every role of one head: the atlas's kinds it passes, then its pattern labels and relations."""
        out = [ROLE[k] for k in self.kinds if float(self.scores[k][layer, head]) >= self.thresholds.get(k, math.inf)]
        if self.labels:
            out += [f"{lab} (pattern)" for lab in self.labels[layer][head]]
        out += [f"syntactic: {r}" for r in self.syntactic.get(f"{layer}.{head}", [])]
        return out

    def share(self, kind: str) -> float:
        """The share of all heads that carry the kind's role."""
        s = self.scores[kind]
        return len(self.heads_of(kind)) / max(1, int((~torch.isnan(s.double())).sum()))

    def summary(self) -> dict:
        """Per kind: how many heads carry the role, their share, the top heads and the verdict."""
        out = {}
        for k in self.kinds:
            v = self.verdicts.get(k)
            out[k] = {
                "heads": [f"{l}.{h}" for l, h in self.heads_of(k)],
                "count": len(self.heads_of(k)),
                "share": round(self.share(k), 4),
                "threshold": self.thresholds.get(k),
                "verdict": None if v is None else v["verdict"],
                "times_random": None if v is None else v.get("times_random"),
                "check_skipped": self.skipped.get(f"{k} check"),
            }
        return out

    def to_json(self) -> dict:
        return envelope(
            "head_atlas",
            {
                "kind_of_result": "head_atlas",
                "model": self.model,
                "family": self.family,
                "causal": self.causal,
                "n_layers": self.n_layers,
                "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads,
                "kv_group": self.kv_group.tolist(),
                "scores": {k: _grid(v) for k, v in self.scores.items()},
                "thresholds": dict(self.thresholds),
                "labels": self.labels,
                "syntactic": self.syntactic,
                "verdicts": self.verdicts,
                "skipped": self.skipped,
                "settings": self.settings,
                "seconds": self.seconds,
                "notes": self.notes,
                "evidence": self.evidence,
                "summary": self.summary(),
            },
            model=self.model,
            settings=self.settings,
        )

    @classmethod
    def from_json(cls, data: dict | str | Path) -> Atlas:
        """An :class:`Atlas` from :meth:`to_json`'s dict, its JSON text, or an ``atlas.json`` file."""
        if isinstance(data, Path) or (isinstance(data, str) and not data.lstrip().startswith("{")):
            path = Path(data)
            if not path.is_file():
                raise InputError(f"no atlas file at {path}; give the atlas.json that `headlab atlas --out DIR` wrote")
            from headlab.reading import read_json_file

            data = read_json_file(path, what="the atlas.json that `headlab atlas --out DIR` wrote")
        if isinstance(data, str):
            data = json.loads(data)
        if not isinstance(data, dict):  # a JSON list or number: AttributeError on .get before
            raise InputError(
                f"not an atlas: a JSON {type(data).__name__}, not an object; give the atlas.json that "
                "`headlab atlas --out DIR` wrote"
            )
        if data.get("kind_of_result") != "head_atlas":
            raise InputError(f"not an atlas: kind_of_result is {data.get('kind_of_result')!r}, expected 'head_atlas'")
        return cls(
            model=data["model"],
            family=data["family"],
            causal=data["causal"],
            n_layers=data["n_layers"],
            n_heads=data["n_heads"],
            n_kv_heads=data["n_kv_heads"],
            kv_group=torch.tensor(data["kv_group"], dtype=torch.long),
            scores={k: _ungrid(v) for k, v in data["scores"].items()},
            thresholds=data["thresholds"],
            labels=data.get("labels", []),
            syntactic=data.get("syntactic", {}),
            verdicts=data.get("verdicts", {}),
            skipped=data.get("skipped", {}),
            settings=data.get("settings", {}),
            seconds=data.get("seconds", {}),
            notes=data.get("notes", []),
            evidence=data.get("evidence", {}),
        )

    def recheck(self, kind: str) -> dict:
        """The kind's verdict recomputed from the per-example effects stored with it (what the JSON reproduces)."""
        from headlab.interpret.atlas.causal import verdict

        v = self.verdicts[kind]
        return verdict(
            v["effects"]["targeted"],
            v["effects"]["random"],
            n_boot=v["n_boot"],
            alpha=v["alpha"],
            ratio=v["ratio"],
            seed=v["seed"],
        )

    def _repr_html_(self) -> str:
        """This atlas's page inline in a notebook (headlab's shell in a sandboxed frame; no network)."""
        from headlab.interpret import shell
        from headlab.interpret.atlas.page import render_page

        return shell.inline(render_page(self))


__all__ = ["KINDS", "ROLE", "Atlas", "Thresholds"]
