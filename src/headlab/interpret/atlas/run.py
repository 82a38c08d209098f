"""``headlab.atlas(model)``: score every head on every kind, then check each label causally.

The kinds are records in :data:`~headlab.interpret.atlas.kinds.KINDS` (one module each under ``kinds/``);
this module only runs them, as an :class:`AtlasRun` of units (phases), each input recorded once
(:func:`headlab.capture` of q, k and the map-free statistics; :mod:`.kinds.shared`):

1. ``repeated``: repeated random tokens -> every kind that ``reads="repeated"`` (previous_token,
   duplicate_token, induction); ``copying``: the OV copying score from the weights alone;
2. ``text``: natural text -> every kind that ``reads="text"`` (sink, local), and the pattern labels of
   :mod:`headlab.interpret.heads.labels`;
3. every other kind, each a unit of its own that builds its own input (``retrieval``: needle-in-a-haystack
   decoding, decoders only; ``syntactic``: the probe on a treebank, when given);
4. ``check TASK``: the causal checks (:mod:`.checks`) of the scored kinds of each task;
5. ``evidence``: the attention maps of each kind's top heads on one short input.

A unit's value is JSON (:mod:`.codec`) and a unit reads only the values of the units before it, so a run
resumed from any unit gives the numbers of a run in one go: every random choice is seeded from ``seed``
where it is made (the repeated tokens, the needle trials, each task's sequences, its random draws and its
bootstrap). :func:`atlas` and ``headlab atlas`` alike run these units through the study runner (the ``atlas``
instrument, :mod:`headlab.interpret.instruments.atlas`): its checks, progress and Ctrl-C, and its checkpoint (the
finished units kept in ``--out/atlas.json``, or in ``resume=PATH`` from Python); :mod:`.assemble` puts the units'
values together into the :class:`Atlas`.

Under torchrun (``torchrun --nproc-per-node N -m headlab atlas ...``) every rank runs every unit, and inside a
unit the needle trials and the checks' configurations are split over the ranks and gathered back, which gives
the one-process result; the score passes are small and run on every rank. On a model sharded by tensor
parallelism (``headlab.load(..., tensor_parallel=True)``) the ranks of a tensor-parallel group make the same
calls: every score pass, and every needle trial and check configuration (a data rank's share of them on a data x
tensor mesh: ``adapter.placement.examples``, :mod:`headlab.distributed.placement`). Each rank scores the heads it
holds, from its own recording, and the grids are added over the group (pattern labels read every head's gathered
statistics); the checks' gates land on the ranks holding the heads; each rank takes the OV copying score of its
own heads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from headlab.checks import int_at_least, int_in_range  # `checks` is atlas()'s own argument
from headlab.errors import ConfigError, InputError
from headlab.interpret.atlas import scores as S
from headlab.interpret.atlas import tasks as T
from headlab.interpret.atlas.assemble import finished, scored
from headlab.interpret.atlas.checks import check_task, task_groups
from headlab.interpret.atlas.codec import encode, fingerprint
from headlab.interpret.atlas.kinds import KINDS, Run
from headlab.interpret.atlas.kinds.shared import INPUTS, pattern_labels
from headlab.interpret.atlas.result import Atlas, Thresholds
from headlab.interpret.study import runner
from headlab.models.loader import load, resolve
from headlab.progress import Progress


def asked_kinds(kinds) -> list[str] | None:
    """``kinds=`` as a list (a name alone is one kind; None: every kind the model allows), an unknown kind refused
    with the kinds there are (the model is not needed: the instrument checks this before the load)."""
    if kinds is None:
        return None
    asked = [kinds] if isinstance(kinds, str) else list(kinds)
    bad = [k for k in asked if k not in KINDS]
    if bad:
        raise ConfigError(f"unknown atlas kind(s) {', '.join(map(repr, bad))}; choose from {', '.join(KINDS)}")
    return asked


def _kinds(kinds, run: Run) -> tuple[list[str], dict[str, str]]:
    """The kinds to score and, for the default set, those left out with the reason; an explicit
    request the model cannot serve is refused before any work."""
    why = {name: r for name, kd in KINDS.items() if (r := kd.unavailable(run)) is not None}
    asked = asked_kinds(kinds)
    if asked is None:
        return [k for k in KINDS if k not in why], why
    for k in asked:
        if k in why:
            raise ConfigError(f"kind {k!r} {why[k]}")
    return [k for k in KINDS if k in asked], {}


def _repeated_scores(run: Run, kinds) -> dict[str, torch.Tensor]:
    """The scores of the kinds that read the repeated random tokens, from one recording of them."""
    return {kd.name: kd.score(run) for kd in kinds}


def _text_scores(run: Run, kinds) -> dict:
    """The scores of the kinds that read the natural text, and the pattern labels of its first piece."""
    return {**{kd.name: kd.score(run) for kd in kinds}, "labels": pattern_labels(run)}


class AtlasRun:
    """One atlas as units: :meth:`units` names them in order, :meth:`unit` computes one from the values of the
    units before it, :meth:`finish` puts every value together into the :class:`Atlas`.

    The arguments are :func:`atlas`'s (``say``: ``progress(stage, done, total)``); they are checked here,
    before any unit runs. ``key`` digests what a unit's value depends on (the model's name and heads, the kinds,
    the sizes, the texts, the treebank): each value carries it, so a value kept for another run is told apart."""

    def __init__(
        self,
        model,
        *,
        kinds: Sequence[str] | str | None = None,
        texts=None,
        treebank=None,
        treebank_limit: int = 200,
        checks: bool = True,
        copying: bool = True,
        k: int | None = None,
        n_draws: int = 10,
        half: int = 50,
        n_repeated: int = 8,
        window: int = 16,
        max_tokens: int = 128,
        n_texts: int = 4,
        needle_trials: int = 4,
        haystack_tokens: int = 256,
        n_boot: int = 1000,
        seed: int = 0,
        max_rows: int = 32,
        thresholds: Thresholds = Thresholds(),
        evidence: bool = True,
        say: Progress = lambda stage, done, total: None,
    ) -> None:
        if isinstance(model, str | os.PathLike):  # a known name or a model folder, as the docstring promises
            model = load(model)
        adapter, loaded = resolve(model)
        tok = getattr(loaded, "tokenizer", None)
        get_out = getattr(adapter.model, "get_output_embeddings", None)
        has_logits = adapter.causal and (
            (callable(get_out) and get_out() is not None) or hasattr(adapter.model, "tok_emb")
        )
        run = Run(
            adapter=adapter,
            loaded=loaded,
            tokenizer=tok,
            has_logits=has_logits,
            treebank=treebank,
            texts=texts,
            sizes={},
            vocab=0,
            max_rows=max_rows,
            say=say,
        )
        todo, skipped = _kinds(kinds, run)
        for name, v, lo in (
            ("n_draws", n_draws, 1),
            ("half", half, 2),
            ("n_repeated", n_repeated, 2),
            ("n_texts", n_texts, 1),
            ("needle_trials", needle_trials, 1),
            ("n_boot", n_boot, 2),
            ("window", window, 2),
            ("max_tokens", max_tokens, 8),
            ("haystack_tokens", haystack_tokens, 8),
            ("max_rows", max_rows, 1),
        ):
            int_at_least(name, v, lo, message="{name} must be an integer of at least {low}, got {value!r}")
        total = sum(adapter.layer_heads)
        k = k if k is not None else max(1, min(10, round(0.05 * total)))
        int_in_range("k (heads gated per check)", k, 1, total - 1)
        if treebank is not None and loaded is None:
            raise InputError("the syntactic kind needs a model with a tokenizer (headlab.load(...)) for the treebank")
        self.kinds = [KINDS[kd] for kd in todo]
        run.vocab = S.embeddings(adapter.model)[0].shape[0]
        run.pieces = (
            T.natural(tok, texts, max_tokens=max_tokens, n=n_texts)
            if any(kd.reads in ("text", "needles") for kd in self.kinds)
            else []
        )
        run.sizes = sizes = {
            "k": k,
            "n_draws": n_draws,
            "half": half,
            "n_repeated": n_repeated,
            "window": window,
            "max_tokens": max_tokens,
            "n_texts": len(run.pieces),
            "needle_trials": needle_trials,
            "haystack_tokens": haystack_tokens,
            "seed": seed,
            "n_boot": n_boot,
            "treebank_limit": treebank_limit,
        }
        if checks:  # the sizes each task needs, refused before any work
            for task in dict.fromkeys(kd.task for kd in self.kinds if kd.task is not None and kd.task.validate):
                assert task.validate is not None  # chosen above
                task.validate(run)
        run.repeated_ids, run.start = T.repeated(tok, vocab=run.vocab, n=n_repeated, half=half, seed=seed)
        self.run, self.todo, self.skipped, self.thresholds = run, todo, skipped, thresholds
        self.copying, self.evidence, self.given_texts = copying, evidence, texts is not None
        self.name = getattr(loaded, "name", None) or type(adapter.model).__name__
        self.tasks = {f"check {task.name}": (task, names) for task, names in task_groups(self.kinds)} if checks else {}
        self.checks = checks
        self.key = fingerprint(
            {
                "model": self.name,
                "heads": adapter.layer_heads,
                "kinds": todo,
                "checks": checks,
                "copying": copying,
                "texts": fingerprint(texts),
                "treebank": str(treebank),
                **sizes,
            }
        )

    def units(self) -> list[str]:
        """The units' keys, in the order they run."""
        out = ["repeated"] if any(kd.reads == "repeated" for kd in self.kinds) else []
        out += (["copying"] if self.copying else []) + (["text"] if self.run.pieces else [])
        out += [kd.name for kd in self.kinds if kd.reads not in INPUTS]
        return out + list(self.tasks) + (["evidence"] if self.evidence else [])

    def unit(self, key: str, kept: dict) -> dict:
        """The value of unit ``key`` as JSON (:mod:`.codec`), from the values of the units before it (``kept``, by
        key, as :meth:`unit` returned them or as a file kept them)."""
        run, t0 = self.run, time.perf_counter()
        if key == "repeated":
            value = self._scoring(
                "repeated tokens", lambda: _repeated_scores(run, [kd for kd in self.kinds if kd.reads == "repeated"])
            )
        elif key == "copying":
            value = self._scoring("copying (OV circuits)", lambda: {"copying": S.ov_copying(run.adapter).double()})
        elif key == "text":
            value = self._scoring(
                "natural text", lambda: _text_scores(run, [kd for kd in self.kinds if kd.reads == "text"])
            )
            value["labels"] = value["scores"].pop("labels")
        elif key in self.tasks:
            task, names = self.tasks[key]
            sz = run.sizes
            value = check_task(
                scored(self, kept),
                run,
                task,
                names,
                k=sz["k"],
                n_draws=sz["n_draws"],
                seed=sz["seed"],
                n_boot=sz["n_boot"],
            )
        elif key == "evidence":
            value = {"evidence": self._evidence(scored(self, kept))}
        else:  # a kind of its own input: its score says its own progress
            value = self._scoring(None, lambda: {key: KINDS[key].score(run)})
        run.forget()  # the recordings of an input live as long as its unit
        return encode({**value, "seconds": time.perf_counter() - t0, "key": self.key})

    def _scoring(self, stage: str | None, compute) -> dict:
        """Scores, with what the scores left in the run (settings, notes, syntactic relations, their task's
        state): all of it kept with the unit."""
        run = self.run
        run.settings, run.notes, run.syntactic, run.state = {}, [], {}, {}
        if stage:
            run.say(stage, 0, 1)
        scores = compute()
        if stage:
            run.say(stage, 1, 1)
        return {
            "scores": scores,
            "settings": run.settings,
            "notes": run.notes,
            "syntactic": run.syntactic,
            "state": run.state,
        }

    def _evidence(self, result: Atlas) -> dict:
        from headlab.interpret.atlas.evidence import evidence_maps

        run, k = self.run, self.run.sizes["k"]
        run.say("evidence maps", 0, 1)
        tok = run.tokenizer
        short = T.repeated(tok, vocab=run.vocab, n=1, half=min(run.sizes["half"], 12), seed=run.sizes["seed"])[0][0]
        name = (lambda t: tok.convert_ids_to_tokens(t)) if tok is not None else str
        maps = evidence_maps(
            run.adapter,
            {kd.name: result.top(kd.name, k) for kd in self.kinds if kd.reads in INPUTS},
            repeated_ids=short,
            text_ids=run.pieces[0][:24] if run.pieces else None,
            tokens=name,
        )
        run.say("evidence maps", 1, 1)
        return maps

    def foreign(self, values: dict) -> list[str]:
        """The units of ``values`` kept for another run (other inputs: a changed texts file, other weights)."""
        return [key for key, v in values.items() if not isinstance(v, dict) or v.get("key") != self.key]

    def finish(self, values: dict, *, resumed: Sequence[str] = (), source=None) -> Atlas:
        """The :class:`Atlas` from every unit's value; ``resumed``: the units read back from ``source``
        (:mod:`.assemble`)."""
        return finished(self, values, resumed=resumed, source=source)


def atlas(
    model,
    *,
    kinds: Sequence[str] | str | None = None,
    texts=None,
    treebank=None,
    treebank_limit: int = 200,
    checks: bool = True,
    copying: bool = True,
    k: int | None = None,
    n_draws: int = 10,
    half: int = 50,
    n_repeated: int = 8,
    window: int = 16,
    max_tokens: int = 128,
    n_texts: int = 4,
    needle_trials: int = 4,
    haystack_tokens: int = 256,
    n_boot: int = 1000,
    seed: int = 0,
    max_rows: int = 32,
    thresholds: Thresholds = Thresholds(),
    progress: bool | Progress | None = None,
    resume=None,
    evidence: bool = True,
) -> Atlas:
    """Score every head of ``model`` on every kind (:data:`KINDS`) and check each kind causally.

    Runs the ``atlas`` instrument through the study runner (:func:`headlab.interpret.study.runner.call`), as
    ``headlab atlas`` does: the same checks (named here by these arguments' names), units, progress and Ctrl-C
    (``KeyboardInterrupt``); under torchrun every rank returns the whole atlas.

    Args:
        model: a model name or folder, a LoadedModel, an ``nn.Module`` of a supported family or an adapter.
        kinds: kinds to score (default: every kind this model and these inputs allow; the others are in
            ``Atlas.skipped`` with the reason).
        texts: natural text for sink, local and the needle haystack: strings, or token-id sequences for a
            model without a tokenizer; default the shipped public-domain passage.
        treebank: a CoNLL-U file for the syntactic kind (the probe, first ``treebank_limit`` sentences).
        checks: run the causal checks. copying: compute the OV copying score (one vocab-sized product).
        k: heads gated per check (default 5% of the heads, 1 to 10).
        n_draws: random draws per check (at least 10 for a verdict the docs stand behind; at most 1,000).
        half, n_repeated: length of the repeated half and number of repeated sequences.
        window: keys counted as local. max_tokens, n_texts: size and number of natural-text pieces.
        needle_trials, haystack_tokens: needle prompts and their haystack length.
        n_boot, seed: bootstrap resamples and the seed of every random choice. max_rows: rows per forward.
        progress: a bar on stderr (True), nothing (None, False) or ``progress(stage, done, total)``
            (:mod:`headlab.progress`).
        evidence: keep the attention maps of each kind's top heads on one short input (:mod:`.evidence`).
        resume: a JSON file that keeps each finished unit of the run (:class:`AtlasRun`: the score phases, each
            task's checks, the evidence maps), the runner's checkpoint (as ``--out/atlas.json`` of an interrupted
            ``headlab atlas``; a name not ending in ``.json`` keeps them in ``STEM.partial.json``); a rerun with
            the same settings after an interrupt reads them back and runs only the rest (units kept for other
            settings or inputs are replaced, and the atlas says so). Removed when the atlas is complete.

    Returns:
        :class:`~headlab.interpret.atlas.result.Atlas`.
    """
    # the atlas instrument's options (headlab.interpret.instruments.atlas): the command's, by their Python names,
    # and the settings and in-memory inputs only Python gives
    options = {
        "model": model,
        "kinds": [kinds] if isinstance(kinds, str) else None if kinds is None else list(kinds),
        "texts_in_memory": texts,
        "treebank": treebank,
        "treebank_limit": treebank_limit,
        "checks": checks,
        "copying": copying,
        "top_k": k,
        "draws": n_draws,
        "half": half,
        "n_repeated": n_repeated,
        "window": window,
        "max_tokens": max_tokens,
        "n_texts": n_texts,
        "needles": needle_trials,
        "haystack": haystack_tokens,
        "n_boot": n_boot,
        "seed": seed,
        "max_rows": max_rows,
        "thresholds": thresholds,
        "evidence": evidence,
        "out": None,  # the command's --out: a Python run writes no atlas.json, only its checkpoint (resume)
    }
    if resume is not None:  # the runner's checkpoint: PATH keeps the finished units, as --out/atlas.json does
        path = Path(resume).expanduser().absolute()
        options.update(out=path.parent, file=path.name, checkpoint=True)
    return runner.call("atlas", options, progress=progress, resume=resume is not None)


__all__ = ["AtlasRun", "asked_kinds", "atlas"]
