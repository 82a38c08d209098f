"""The :class:`~headlab.interpret.atlas.result.Atlas` from the values of an atlas's units.

An atlas runs as units (:class:`~headlab.interpret.atlas.run.AtlasRun`: the score phases, each task's checks, the
evidence maps), each value JSON (:mod:`.codec`), kept by the study runner on Ctrl-C and read back by ``--resume``.
This module only reads such values back and puts them together: :func:`scored` the atlas of the score phases (what
a check reads: the top heads of each kind), :func:`finished` the whole atlas (verdicts, evidence, time per phase).
``plan`` is the :class:`~headlab.interpret.atlas.run.AtlasRun` whose units the values are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from headlab.interpret.atlas import scores as S
from headlab.interpret.atlas.codec import decode
from headlab.interpret.atlas.result import Atlas

#: where a phase's seconds are counted in ``Atlas.seconds`` (a kind of its own input: its name; a check: "checks")
_TIMED = {"copying": "repeated", "text": "natural_text", "evidence": None}


def _copying_note(adapter) -> str:
    tied = S.embeddings(adapter.model)[2]
    return "copying: sum(eigenvalues) / sum(|eigenvalues|) of W_E W_V W_O W_U (Olsson et al.), no layer norms; " + (
        "the unembedding is the embedding's transpose" if tied else "the model's own unembedding"
    )


def scored(plan, values: dict) -> Atlas:
    """The atlas of the score phases in ``values`` (no verdicts yet); ``plan.run.state`` as their scores left it
    (what each task's check reads)."""
    run, adapter = plan.run, plan.run.adapter
    grids: dict = {}
    notes: list[str] = []
    settings: dict = {}
    syntactic: dict = {}
    state: dict = {}
    labels: list = []
    for key in plan.units():
        if key not in values or key in plan.tasks or key == "evidence":
            continue
        v = decode(values[key])
        grids.update(v["scores"])
        notes += v["notes"]
        settings.update(v["settings"])
        syntactic.update(v["syntactic"])
        state.update(v["state"])
        labels = v.get("labels", labels)
    run.state = state
    scores = {kind: grids[kind] for kind in plan.todo}
    if plan.copying:
        scores["copying"] = grids["copying"]
        notes.append(_copying_note(adapter))
    H, Hkv = adapter.n_heads, adapter.n_kv_heads
    kv_group = torch.arange(H).div(H // Hkv, rounding_mode="floor").expand(adapter.n_layers, H).clone()
    return Atlas(
        model=plan.name,
        family=adapter.family,
        causal=adapter.causal,
        n_layers=adapter.n_layers,
        n_heads=H,
        n_kv_heads=Hkv,
        kv_group=kv_group,
        scores=scores,
        thresholds=plan.thresholds.as_dict(),
        labels=labels,
        syntactic=syntactic,
        skipped=dict(plan.skipped),
        notes=notes,
        settings={
            **run.sizes,
            "start": run.start,
            "texts": "given" if plan.given_texts else "shipped passage",
            **settings,
        },
    )


def finished(plan, values: dict, *, resumed: Sequence[str] = (), source=None) -> Atlas:
    """The whole atlas from every unit's value; ``resumed``: the units read back from ``source``."""
    result = scored(plan, values)
    seconds = {"repeated": 0.0, "natural_text": 0.0}
    for key in plan.units():
        v = decode(values[key])
        if key in plan.tasks:
            result.verdicts.update(v["verdicts"])
            result.skipped.update(v["skipped"])
        elif key == "evidence":
            result.evidence = v["evidence"]
        group = "checks" if key in plan.tasks else _TIMED.get(key, key)
        if group is not None:
            seconds[group] = seconds.get(group, 0.0) + v["seconds"]
    if plan.checks:
        seconds.setdefault("checks", 0.0)
    if resumed:
        result.notes.append(f"resumed: {', '.join(resumed)} read back from {source}")
    result.seconds = {n: round(s, 3) for n, s in seconds.items()}
    return result


__all__ = ["finished", "scored"]
