"""The study: :func:`probe` runs a model over a treebank and scores every head on every relation.

One pass over the sentences, sorted by length and batched so that the captured maps of a batch stay
under ``batch_bytes``. Per batch, all heads of all layers at once: the maps ``(B, K, T, T)``
(K = layers x heads), word-level attention by two matrix products, the most-attended other word,
and per-relation hits by ``scatter_add``; no Python loop over words or heads. The head map uses the
first ``head_map_sentences`` sentences and the gradient test the first ``grad_sentences`` (a
second pass with autograd on the loss model, :mod:`.gradient`).

The work is :class:`ProbeRun`'s units, decided before any of it: each batch of the main pass and each batch
of the gradient test is one unit whose value is its sums (hits, gold counts, surface measures, Jensen-Shannon
sums of the head-map sentences it holds; gradient sums), as JSON; the result adds them in order. The ``probe`` instrument
runs them through the study runner, for ``headlab probe`` (split over the ranks under torchrun, gathered on rank
0, kept on Ctrl-C, resumed with ``--resume``) and for :func:`probe` alike (split, and gathered on every rank).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from headlab.errors import InputError
from headlab.interpret.capture import capture
from headlab.interpret.probing import align as al
from headlab.interpret.probing.gold import OFFSETS, GoldCounts, gold_counts
from headlab.interpret.probing.gradient import GRADS, gradient_batch, resolve_loss_model
from headlab.interpret.probing.measures import SurfaceStats, classical_mds, js_sums
from headlab.interpret.probing.probe_result import MEASURES, ProbeResult
from headlab.interpret.probing.treebank import Skipped, Treebank, read_treebank
from headlab.progress import Progress

BATCH_BYTES = 192 << 20  # the captured maps of one batch (float32, every layer and head)
MAX_BATCH = 256
HEAD_MAP_SENTENCES = 100
HEAD_MAP_BUDGET = 100_000_000  # K^2 * t * rows elements over the head-map sentences (the JS cost)
GRAD_SENTENCES = 50


def _is_causal(loaded) -> bool:
    return loaded.adapter.causal


def _batches(items: Sequence[al.Aligned], K: int, budget: int) -> list[list[al.Aligned]]:
    """Sentences sorted by token count, cut where ``B * K * T^2 * 4`` bytes would pass ``budget``."""
    out: list[list[al.Aligned]] = []
    batch: list[al.Aligned] = []
    for a in sorted(items, key=lambda a: a.n_tokens):
        T = a.n_tokens
        if batch and ((len(batch) + 1) * K * T * T * 4 > budget or len(batch) >= MAX_BATCH):
            out.append(batch)
            batch = []
        batch.append(a)
    if batch:
        out.append(batch)
    return out


def _model_inputs(loaded, batch: al.Batch) -> dict:
    inputs: dict[str, torch.Tensor | int] = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    forward = getattr(type(loaded.model), "forward", None)
    if forward is not None and "logits_to_keep" in inspect.signature(forward).parameters:
        inputs["logits_to_keep"] = 1  # an LM head over every position is a fifth of a small decoder's cost
    return inputs


def _patterns(loaded, batch: al.Batch, backend) -> torch.Tensor:
    """``(B, K, T, T)``: every layer's maps, layer-major over K."""
    cache = capture(loaded, _model_inputs(loaded, batch), loaded.adapter.sites("pattern"), backend=backend)
    return torch.cat(cache.layer("pattern"), dim=1).float()  # (B, sum of H_l, T, T): layers may differ (pruned)


def _on_grid(x: np.ndarray, counts: Sequence[int], axis: int = 0) -> np.ndarray:
    """``x`` with one entry per real head (layer-major, ``sum(counts)`` along ``axis``) laid on the
    ``(n_layers, max(counts))`` grid, NaN where a pruned layer has no such head.

    >>> _on_grid(np.array([1., 2., 3.]), [1, 2]).tolist()
    [[1.0, nan], [2.0, 3.0]]
    """
    x = np.moveaxis(np.asarray(x, dtype=float), axis, 0)
    out = np.full((len(counts), max(counts), *x.shape[1:]), np.nan)
    start = 0
    for layer, n in enumerate(counts):
        out[layer, :n] = x[start : start + n]
        start += n
    return np.moveaxis(out, (0, 1), (axis, axis + 1))


def choose_relations(treebank: Treebank, relations: Sequence[str] | str | None) -> list[str]:
    """The relations to study, most frequent first; unknown names raise :class:`InputError` listing the known."""
    counts = treebank.relation_counts()
    known = [r for r, _ in counts.most_common()]
    if relations is None:
        return known
    wanted = [r.strip() for r in (relations.split(",") if isinstance(relations, str) else relations) if r.strip()]
    if not wanted:
        raise InputError("no relation given; name some, e.g. --relations det,nsubj,obj")
    missing = [r for r in wanted if r not in counts]
    if missing:
        raise InputError(
            f"relation{'s' if len(missing) > 1 else ''} {', '.join(repr(m) for m in missing)} "
            f"{'do' if len(missing) > 1 else 'does'} not occur in {treebank.path}"
            f"{' (subtypes folded)' if treebank.fold_subtypes else ''}; it has: {', '.join(known)}"
        )
    return [r for r in known if r in wanted]


class ProbeRun:
    """One probe as units, decided before any work from the treebank and the model: ``batch N`` (a batch of the
    main pass, sorted by length and cut by ``batch_bytes``: its hits, gold counts, surface sums and the
    Jensen-Shannon sums of the head-map sentences it holds) and ``gradients N`` (a batch of the gradient test).
    :meth:`unit` computes one as JSON-able sums (so an interrupted run keeps it), :meth:`finish` adds them in
    the order of :meth:`units` into the :class:`ProbeResult`. The arguments are :func:`probe`'s, checked here.
    Every unit stands alone: under torchrun the study runner splits them over the ranks and gathers them."""

    def __init__(
        self,
        loaded,
        treebank: str | os.PathLike | Treebank,
        *,
        limit: int | None = None,
        backend: str | None = "auto",
        relations: Sequence[str] | str | None = None,
        fold_subtypes: bool = False,
        head_map_sentences: int = HEAD_MAP_SENTENCES,
        head_map_budget: int = HEAD_MAP_BUDGET,
        grad_sentences: int = GRAD_SENTENCES,
        loss_model="auto",
        min_count: int = 10,
        batch_bytes: int = BATCH_BYTES,
    ) -> None:
        from headlab.models.loader import LoadedModel, load

        self.t0 = time.perf_counter()
        for name, v in (("head_map_sentences", head_map_sentences), ("grad_sentences", grad_sentences)):
            if v < 0:
                raise InputError(f"{name} must be 0 or more, got {v}")
        tb = (
            treebank
            if isinstance(treebank, Treebank)
            # already read (the probe instrument)
            else read_treebank(treebank, fold_subtypes=fold_subtypes, limit=limit)
        )  # bad input first, then the model
        names = choose_relations(tb, relations)
        if not isinstance(loaded, LoadedModel):
            loaded = load(loaded)
        al.check_fast(loaded.tokenizer, loaded.name)
        chosen, grad_note = (
            resolve_loss_model(loaded, loss_model)
            if grad_sentences
            else (None, "gradient test not run (grad_sentences=0)")
        )
        heads = loaded.adapter.layer_heads  # a pruned model's layers may differ
        K = sum(heads)
        items, align_skips = al.align_sentences(loaded.tokenizer, tb.sentences, max_positions=loaded.max_positions)
        skipped = list(tb.skipped) + [Skipped(i, why) for i, why in align_skips]
        if not items:
            raise InputError(
                f"no sentence of {tb.path} can be probed with {loaded.name}: {skipped[0].sent_id}: {skipped[0].reason}"
                if skipped
                else "no sentence"
            )
        mean_t = float(np.mean([a.n_tokens for a in items[:head_map_sentences]])) if head_map_sentences else 1.0
        self.rows_each = max(1, int(head_map_budget / (K * K * mean_t * max(1, min(head_map_sentences, len(items))))))
        self.map_ids = {id(a) for a in items[:head_map_sentences]}
        self.batches = _batches(items, K, batch_bytes)
        self.grad_batches: list[list[al.Aligned]] = []
        if chosen is not None:
            sentences = [a.sentence for a in items[:grad_sentences]]
            grad_items, _ = al.align_sentences(chosen.tokenizer, sentences, max_positions=chosen.max_positions)
            self.grad_batches = _batches(grad_items, K * 4, batch_bytes)  # autograd keeps activations: smaller
            self.grad_count = min(grad_sentences, len(items))
        self.loaded, self.tb, self.names, self.chosen, self.grad_note = loaded, tb, names, chosen, grad_note
        self.items, self.skipped, self.backend, self.min_count = items, skipped, backend, min_count
        self.rel_index = {r: i for i, r in enumerate(names)}
        self.causal = _is_causal(loaded)
        self.key = hashlib.sha256(
            json.dumps(
                [  # what a unit's value depends on: a value kept for another is refused
                    loaded.name,
                    heads,
                    names,
                    [
                        (
                            a.sentence.sent_id,
                            a.sentence.text,
                            a.sentence.heads.tolist(),
                            list(a.sentence.relations),
                            a.n_tokens,
                        )
                        for a in items
                    ],
                    head_map_sentences,
                    self.rows_each,
                    grad_sentences,
                    chosen is not None and chosen.name,
                    batch_bytes,
                ]
            ).encode()
        ).hexdigest()[:16]

    def units(self) -> list[str]:
        """The units' keys, in the order :meth:`finish` adds them."""
        return [f"batch {i + 1}" for i in range(len(self.batches))] + [
            f"gradients {i + 1}" for i in range(len(self.grad_batches))
        ]

    def unit(self, key: str) -> dict:
        """The sums of unit ``key`` as JSON-able lists."""
        what, n = key.split(" ")
        if what == "gradients":
            sums, counts = gradient_batch(self.chosen, self.grad_batches[int(n) - 1], self.causal, self.backend)
            return {"plan": self.key, "sums": [s.tolist() for s in sums], "counts": counts}
        group = self.batches[int(n) - 1]
        K = sum(self.loaded.adapter.layer_heads)
        pad = getattr(self.loaded.tokenizer, "pad_token_id", None)
        b = al.make_batch(group, self.rel_index, 0 if pad is None else pad)
        surface = SurfaceStats(K)
        js, js_rows, in_map = None, 0.0, 0
        with torch.inference_mode():
            att = _patterns(self.loaded, b, self.backend)  # (B, K, T, T)
            valid = b.attention_mask.bool()
            correct = al.score(al.predict(al.word_attention(att, b.a_to), b.candidates), b, len(self.names))
            gold = gold_counts([a.sentence for a in group], self.rel_index)
            surface.add(att, valid, b.sep, b.punct)
            for k, a in enumerate(group):
                if id(a) in self.map_ids:
                    t = a.n_tokens
                    # evenly spaced from the last row back (a decoder's first row is all on token 0)
                    rows = np.unique(
                        np.linspace(t - 1, 0, min(t, self.rows_each) + 1)[: min(t, self.rows_each)].round().astype(int)
                    )
                    js = js_sums(att[k, :, rows, :t]) if js is None else js + js_sums(att[k, :, rows, :t])
                    js_rows += len(rows)
                    in_map += 1
        return {
            "plan": self.key,
            "sentences": len(group),
            "tokens": int(valid.sum()),
            "correct": correct.tolist(),
            "gold": [gold.count.tolist(), gold.visible.tolist(), gold.correct.tolist()],
            "surface": {k: v.tolist() for k, v in surface.sums.items()},
            "n_query": surface.n_query,
            "n_pairs": surface.n_pairs,
            "any_sep": surface.any_sep,
            "js": None if js is None else js.tolist(),
            "js_rows": js_rows,
            "in_map": in_map,
        }

    def check(self, values: dict) -> None:
        """Units kept from an earlier run (``--resume``) must be this plan's: another treebank, model or batching
        under the same options is an :class:`InputError`."""
        stale = sorted(k for k, v in values.items() if not isinstance(v, dict) or v.get("plan") != self.key)
        if stale:
            raise InputError(
                f"the kept units {', '.join(stale)} were computed for another treebank, model or "
                "batching; drop --resume to start again"
            )

    def finish(self, values: dict) -> ProbeResult:
        """The :class:`ProbeResult` of the units in ``values`` (by key), added in order. Missing batches (a run
        stopped part-way) leave a note and no gradient test; no batch at all is a KeyboardInterrupt."""
        self.check(values)
        loaded, heads, R = self.loaded, self.loaded.adapter.layer_heads, len(self.names)
        L, H, K = loaded.adapter.n_layers, loaded.adapter.n_heads, sum(heads)
        correct = torch.zeros(2, K, R)
        gold = GoldCounts(np.zeros((2, R)), np.zeros((2, R)), np.zeros((2, len(OFFSETS), R)))
        surface = SurfaceStats(K)
        js = torch.zeros(K, K, dtype=torch.float64)
        js_rows, done, n_tokens, in_map = 0.0, 0, 0, 0
        batches = [values[k] for k in self.units() if k.startswith("batch ") and k in values]
        for v in batches:
            correct += torch.tensor(v["correct"], dtype=correct.dtype)
            gold += GoldCounts(*(np.asarray(x, dtype=float) for x in v["gold"]))
            for k, s in v["surface"].items():
                surface.sums[k] += torch.tensor(s, dtype=torch.float64)
            surface.n_query += v["n_query"]
            surface.n_pairs += v["n_pairs"]
            surface.any_sep = surface.any_sep or v["any_sep"]
            if v["js"] is not None:
                js += torch.tensor(v["js"], dtype=torch.float64)
            js_rows += v["js_rows"]
            done, n_tokens, in_map = done + v["sentences"], n_tokens + v["tokens"], in_map + v["in_map"]
        if not batches:
            raise KeyboardInterrupt
        graded = self.chosen is not None and len(batches) == len(self.batches)  # not after an interrupt
        notes = (
            []
            if len(batches) == len(self.batches)
            else [f"interrupted after {done} of {len(self.items)} sentences: the figures cover those"]
        )
        per_head = {k: np.full((L, H), np.nan) for k in MEASURES}
        for measure, grid in surface.means().items():
            per_head[measure] = _on_grid(grid, heads)
        if graded:
            sums = [torch.zeros(K, dtype=torch.float64) for _ in GRADS]
            counts = [0.0 for _ in GRADS]
            for k in self.units():
                if k.startswith("gradients ") and k in values:
                    for i in range(len(GRADS)):
                        sums[i] += torch.tensor(values[k]["sums"][i], dtype=torch.float64)
                        counts[i] += values[k]["counts"][i]
            per_head.update(
                {name: _on_grid((sums[i] / max(counts[i], 1.0)).numpy(), heads) for i, name in enumerate(GRADS)}
            )
        head_map = None
        if in_map >= 1 and js_rows:
            head_map = _on_grid(classical_mds(np.sqrt((js / js_rows).numpy())), heads).reshape(L * H, 2)
        count = gold.count
        acc = _on_grid(correct.numpy() / np.maximum(count[:, None, :], 1), heads, axis=1)  # (2, L, H, R)
        base = gold.correct / np.maximum(count[:, None, :], 1)  # (2, O, R)
        best = base.argmax(1)
        offsets = np.asarray(OFFSETS)[best]
        base_acc = np.take_along_axis(base, best[:, None, :], 1)[:, 0]
        if self.causal:
            notes.append(
                "causal model: a word sees only earlier words, so dep->head can be right only when the head "
                "comes first and head->dep only when a dependent does (the 'visible' share of each relation)"
            )
        return ProbeResult(
            model=loaded.name,
            family=loaded.family,
            causal=self.causal,
            treebank=self.tb.path,
            n_layers=L,
            n_heads=H,
            sentences=done,
            tokens=n_tokens,
            relation_names=self.names,
            accuracy=acc,
            count=count,
            visible=gold.visible,
            baseline_accuracy=base_acc,
            baseline_offset=offsets,
            per_head=per_head,
            skipped=self.skipped,
            head_map=head_map,
            head_map_sentences=in_map,
            grad_note=self.grad_note + (f" ({self.grad_count} sentences)" if graded else ""),
            seconds=time.perf_counter() - self.t0,
            notes=notes,
            fold_subtypes=self.tb.fold_subtypes,
            min_count=self.min_count,
        )


def probe(
    loaded,
    treebank_path: str | os.PathLike | Treebank,
    *,
    limit: int | None = None,
    backend: str | None = "auto",
    relations: Sequence[str] | str | None = None,
    fold_subtypes: bool = False,
    head_map_sentences: int = HEAD_MAP_SENTENCES,
    head_map_budget: int = HEAD_MAP_BUDGET,
    grad_sentences: int = GRAD_SENTENCES,
    loss_model="auto",
    min_count: int = 10,
    batch_bytes: int = BATCH_BYTES,
    progress: bool | Progress | None = None,
) -> ProbeResult:
    """Score every attention head of ``loaded`` against the gold trees of a CoNLL-U file.

    Args:
        loaded: a :class:`~headlab.models.loader.LoadedModel` (``headlab.load(...)``) or a known name /
            model folder; it needs a fast tokenizer (character offsets).
        treebank_path: a CoNLL-U file (see :mod:`~headlab.interpret.probing.treebank`), or its
            :class:`~headlab.interpret.probing.treebank.Treebank` already read (``limit`` and ``fold_subtypes``
            were applied when it was read).
        limit: read at most this many sentences from the top of the file.
        backend: the backend of layers not captured (every layer is, so this rarely matters).
        relations: study only these (``"det,nsubj"`` or a list); default every relation in the file.
        fold_subtypes: ``nmod:poss`` counts as ``nmod``.
        head_map_sentences: sentences whose maps feed the Jensen-Shannon head map (0: no map), from
            the top of the file. Their query rows are thinned (evenly spaced) so that the cost
            ``K^2 * t * rows`` (K heads, t tokens) stays near ``head_map_budget``.
        grad_sentences: sentences for the gradient ("no-op") test (0: not run).
        loss_model: ``"auto"`` (the model's own LM/classification loss; for the bare MiniLM encoder,
            the cached SST-2 classifier ``cache_dir("minilm-sst2")`` when present), a model or
            folder with such a head and the same heads, or None.
        min_count: a relation needs this many cases before a head counts as beating its baseline.
        batch_bytes: the captured maps of one batch stay below this.
        progress: a bar on stderr (True), nothing (None, False) or ``progress(stage, done, total)``
            (:mod:`headlab.progress`); only rank 0 reports.

    The ``probe`` instrument runs it, as it runs ``headlab probe`` (the study runner's
    :func:`~headlab.interpret.study.runner.call`): the checks, the units of :class:`ProbeRun` (each batch of
    sentences, then each batch of the gradient test), the progress (a stage per unit after the load) and, under
    torchrun, the batches split over the ranks and every rank returning the whole result. Ctrl-C raises
    ``KeyboardInterrupt``.

    Returns:
        :class:`~headlab.interpret.probing.probe_result.ProbeResult`.
    """
    from headlab.interpret.study import runner

    read = isinstance(treebank_path, Treebank)
    options = {
        "model": loaded,
        "treebank": None if isinstance(treebank_path, Treebank) else Path(os.fspath(treebank_path)),
        "trees": treebank_path if read else None,
        "limit": limit,
        "backend": backend,
        "relations": relations,
        "fold_subtypes": fold_subtypes,
        "head_map_sentences": head_map_sentences,
        "head_map_budget": head_map_budget,
        "grad_sentences": grad_sentences,
        "loss_model": loss_model,
        "min_count": min_count,
        "batch_bytes": batch_bytes,
    }
    return runner.call("probe", options, progress=progress)


__all__ = ["BATCH_BYTES", "ProbeRun", "choose_relations", "probe", "resolve_loss_model"]
