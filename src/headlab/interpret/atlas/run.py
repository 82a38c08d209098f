"""``headlab.atlas(model)``: score every head on every kind, then check each label causally.

The kinds are records in :data:`~headlab.interpret.atlas.kinds.KINDS` (one module each under ``kinds/``);
this module only runs them, in phases, each recorded once (:func:`headlab.capture` of q, k and the
map-free statistics; :mod:`.kinds.shared`):

1. repeated random tokens -> every kind that ``reads="repeated"`` (previous_token, duplicate_token,
   induction); the OV copying score from the weights alone;
2. natural text -> every kind that ``reads="text"`` (sink, local), and the pattern labels of
   :mod:`headlab.interpret.heads.labels`;
3. every other kind, each in a phase of its own that builds its own input (retrieval: needle-in-a-haystack
   decoding, decoders only; syntactic: the probe on a treebank, when given);
4. the causal checks (:mod:`.checks`) of every scored kind with a task.

Under torchrun (``torchrun --nproc-per-node N -m headlab atlas ...``) the needle trials and the checks'
configurations are split over the ranks and gathered back, which gives the one-process result; the
score passes are small and run on every rank. On a model sharded by tensor parallelism
(``headlab.load(..., tensor_parallel=True)``) the ranks of a tensor-parallel group make the same calls: every
score pass, and every needle trial and check configuration (a data rank's share of them on a data x tensor
mesh: ``adapter.placement.examples``, :mod:`headlab.distributed.placement`). Each rank scores the heads it
holds, from its own recording, and the grids are added over the group (pattern labels read every head's gathered statistics); the
checks' gates land on the ranks holding the heads; each rank takes the OV copying score of its own heads.
With ``resume=``, finished phases survive an interrupt.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from headlab.checks import int_at_least, int_in_range  # `checks` is atlas()'s own argument
from headlab.errors import ConfigError, InputError
from headlab.interpret.atlas import scores as S
from headlab.interpret.atlas import tasks as T
from headlab.interpret.atlas.kinds import KINDS, Run
from headlab.interpret.atlas.kinds.shared import INPUTS, pattern_labels
from headlab.interpret.atlas.result import Atlas, Thresholds
from headlab.interpret.atlas.resume import Checkpoint, fingerprint
from headlab.models.loader import load, resolve
from headlab.progress import Progress, reporter


def _kinds(kinds, run: Run) -> tuple[list[str], dict[str, str]]:
    """The kinds to score and, for the default set, those left out with the reason; an explicit
    request the model cannot serve is refused before any work."""
    why = {name: r for name, kd in KINDS.items() if (r := kd.unavailable(run)) is not None}
    if kinds is None:
        return [k for k in KINDS if k not in why], why
    asked = [kinds] if isinstance(kinds, str) else list(kinds)
    bad = [k for k in asked if k not in KINDS]
    if bad:
        raise ConfigError(f"unknown atlas kind(s) {', '.join(map(repr, bad))}; choose from {', '.join(KINDS)}")
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


def atlas(model, *, kinds: Sequence[str] | str | None = None, texts=None, treebank=None, treebank_limit: int = 200,
          checks: bool = True, copying: bool = True, k: int | None = None, n_draws: int = 10, half: int = 50,
          n_repeated: int = 8,
          window: int = 16, max_tokens: int = 128, n_texts: int = 4, needle_trials: int = 4,
          haystack_tokens: int = 256, n_boot: int = 1000, seed: int = 0, max_rows: int = 32,
          thresholds: Thresholds = Thresholds(), progress: bool | Progress | None = None, resume=None,
          evidence: bool = True) -> Atlas:
    """Score every head of ``model`` on every kind (:data:`KINDS`) and check each kind causally.

    Args:
        model: a model name or folder, a LoadedModel, an ``nn.Module`` of a supported family or an adapter.
        kinds: kinds to score (default: every kind this model and these inputs allow; the others are in
            ``Atlas.skipped`` with the reason).
        texts: natural text for sink, local and the needle haystack: strings, or token-id sequences for a
            model without a tokenizer; default the shipped public-domain passage.
        treebank: a CoNLL-U file for the syntactic kind (the probe, first ``treebank_limit`` sentences).
        checks: run the causal checks. copying: compute the OV copying score (one vocab-sized product).
        k: heads gated per check (default 5% of the heads, 1 to 10).
        n_draws: random draws per check (at least 10 for a verdict the docs stand behind).
        half, n_repeated: length of the repeated half and number of repeated sequences.
        window: keys counted as local. max_tokens, n_texts: size and number of natural-text pieces.
        needle_trials, haystack_tokens: needle prompts and their haystack length.
        n_boot, seed: bootstrap resamples and the seed of every random choice. max_rows: rows per forward.
        progress: a bar on stderr (True), nothing (None, False) or ``progress(stage, done, total)``
            (:mod:`headlab.progress`).
        evidence: keep the attention maps of each kind's top heads on one short input (:mod:`.evidence`).
        resume: a file that keeps each finished phase (:mod:`.resume`); a rerun with the same settings
            after an interrupt reads them back and runs only the rest. Removed when the atlas is complete.

    Returns:
        :class:`~headlab.interpret.atlas.result.Atlas`.
    """
    if isinstance(model, str | os.PathLike):  # a known name or a model folder, as the docstring promises
        model = load(model)
    adapter, loaded = resolve(model)
    tok = getattr(loaded, "tokenizer", None)
    get_out = getattr(adapter.model, "get_output_embeddings", None)
    has_logits = adapter.causal and ((callable(get_out) and get_out() is not None) or hasattr(adapter.model, "tok_emb"))
    with reporter(progress) as say:  # the one display (headlab.progress)
        run = Run(adapter=adapter, loaded=loaded, tokenizer=tok, has_logits=has_logits, treebank=treebank, texts=texts,
                  sizes={}, vocab=0, max_rows=max_rows, checkpoint=None, say=say)
        todo, skipped = _kinds(kinds, run)
        for name, v, lo in (("n_draws", n_draws, 1), ("half", half, 2), ("n_repeated", n_repeated, 2),
                            ("n_texts", n_texts, 1), ("needle_trials", needle_trials, 1), ("n_boot", n_boot, 2),
                            ("window", window, 2), ("max_tokens", max_tokens, 8), ("haystack_tokens", haystack_tokens, 8),
                            ("max_rows", max_rows, 1)):
            int_at_least(name, v, lo, message="{name} must be an integer of at least {low}, got {value!r}")
        total = sum(adapter.layer_heads)
        k = k if k is not None else max(1, min(10, round(0.05 * total)))
        int_in_range("k (heads gated per check)", k, 1, total - 1)
        if treebank is not None and loaded is None:
            raise InputError("the syntactic kind needs a model with a tokenizer (headlab.load(...)) for the treebank")
        kinds_todo = [KINDS[kd] for kd in todo]
        run.vocab = vocab = S.embeddings(adapter.model)[0].shape[0]
        run.pieces = pieces = T.natural(tok, texts, max_tokens=max_tokens, n=n_texts) \
            if any(kd.reads in ("text", "needles") for kd in kinds_todo) else []
        run.sizes = sizes = {
            "k": k, "n_draws": n_draws, "half": half, "n_repeated": n_repeated, "window": window, "max_tokens": max_tokens,
            "n_texts": len(pieces), "needle_trials": needle_trials, "haystack_tokens": haystack_tokens, "seed": seed,
            "n_boot": n_boot, "treebank_limit": treebank_limit}
        if checks:  # the sizes each task needs, refused before any work
            for task in dict.fromkeys(kd.task for kd in kinds_todo if kd.task is not None and kd.task.validate):
                task.validate(run)
        seconds, notes = {}, []
        run.checkpoint = ck = Checkpoint(resume, {
            "model": getattr(loaded, "name", None) or type(adapter.model).__name__, "heads": adapter.layer_heads,
            "kinds": todo, "checks": checks, "copying": copying, "texts": fingerprint(texts), "treebank": str(treebank),
            **sizes})
        grids = {}
        run.repeated_ids, run.start = T.repeated(tok, vocab=vocab, n=n_repeated, half=half, seed=seed)
        t0 = time.perf_counter()
        rep = [kd for kd in kinds_todo if kd.reads == "repeated"]
        if rep:
            say("repeated tokens", 0, 1)
            grids.update(ck.run("repeated", lambda: _repeated_scores(run, rep)))
            say("repeated tokens", 1, 1)
        copying_grid = None
        if copying:
            say("copying (OV circuits)", 0, 1)
            copying_grid = ck.run("copying", lambda: S.ov_copying(adapter).double())
            say("copying (OV circuits)", 1, 1)
        seconds["repeated"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        labels = []
        if pieces:
            say("natural text", 0, 1)
            got = ck.run("text", lambda: _text_scores(run, [kd for kd in kinds_todo if kd.reads == "text"]))
            labels = got.pop("labels")
            grids.update(got)
            say("natural text", 1, 1)
        seconds["natural_text"] = time.perf_counter() - t0
        for kd in kinds_todo:  # the kinds of their own input (needles, a treebank, ...), each its own phase
            if kd.reads not in INPUTS:
                t0 = time.perf_counter()
                grids[kd.name] = kd.score(run)
                seconds[kd.name] = time.perf_counter() - t0
        run.forget()  # the recordings of the inputs: the checks run their own forwards
        notes += run.notes
        scores = {kind: grids[kind] for kind in todo}
        if copying_grid is not None:
            scores["copying"] = copying_grid
        H, Hkv = adapter.n_heads, adapter.n_kv_heads
        kv_group = torch.arange(H).div(H // Hkv, rounding_mode="floor").expand(adapter.n_layers, H).clone()
        tied = S.embeddings(adapter.model)[2]
        if copying_grid is not None:
            notes.append("copying: sum(eigenvalues) / sum(|eigenvalues|) of W_E W_V W_O W_U (Olsson et al.), no layer norms; "
                         + ("the unembedding is the embedding's transpose" if tied else "the model's own unembedding"))
        result = Atlas(model=getattr(loaded, "name", None) or type(adapter.model).__name__, family=adapter.family,
                       causal=adapter.causal, n_layers=adapter.n_layers, n_heads=H, n_kv_heads=Hkv, kv_group=kv_group,
                       scores=scores, thresholds=thresholds.as_dict(), labels=labels, syntactic=run.syntactic,
                       skipped=skipped, notes=notes,
                       settings={**sizes, "start": run.start, "texts": "given" if texts is not None else "shipped passage",
                                 **run.settings})
        if checks:
            t0 = time.perf_counter()
            from headlab.interpret.atlas.checks import run_checks

            run_checks(result, run, kinds_todo, k=k, n_draws=n_draws, seed=seed, n_boot=n_boot)
            seconds["checks"] = time.perf_counter() - t0
        if ck.resumed:
            result.notes.append(f"resumed: {', '.join(ck.resumed)} read back from {ck.path} (their seconds are not counted)")
        if ck.stale:
            result.notes.append(f"{ck.path} held another run's phases (other settings); they were replaced")
        if evidence:
            from headlab.interpret.atlas.evidence import evidence_maps

            say("evidence maps", 0, 1)
            short = T.repeated(tok, vocab=vocab, n=1, half=min(half, 12), seed=seed)[0][0]
            name = (lambda t: tok.convert_ids_to_tokens(t)) if tok is not None else str
            result.evidence = evidence_maps(adapter, {kd.name: result.top(kd.name, k) for kd in kinds_todo
                                                      if kd.reads in INPUTS},
                                            repeated_ids=short, text_ids=pieces[0][:24] if pieces else None, tokens=name)
            say("evidence maps", 1, 1)
        ck.finish()
        result.seconds = {n: round(s, 3) for n, s in seconds.items()}
        return result


__all__ = ["atlas"]
