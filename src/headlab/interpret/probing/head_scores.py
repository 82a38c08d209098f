"""The study: :func:`probe` runs a model over a treebank and scores every head on every relation.

One pass over the sentences, sorted by length and batched so that the captured maps of a batch stay
under ``batch_bytes``. Per batch, all heads of all layers at once: the maps ``(B, K, T, T)``
(K = layers x heads), word-level attention by two matrix products, the most-attended other word,
and per-relation hits by ``scatter_add``; no Python loop over words or heads. The head map uses the
first ``head_map_sentences`` sentences and the gradient test the first ``grad_sentences`` (a
second pass with autograd on the loss model).

Data-parallel under ``torchrun``: each rank takes every W-th sentence (of both passes), the sums
(hits, gold counts, surface measures, Jensen-Shannon sums, gradients) are added across ranks with one
all-reduce per pass, so every rank returns the single-process result; rank 0 shows progress.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from headlab.distributed.data import is_main
from headlab.errors import InputError, ModelError
from headlab.interpret.capture import capture
from headlab.interpret.probing import align as al
from headlab.interpret.probing.gold import OFFSETS, GoldCounts, gold_counts
from headlab.interpret.probing.measures import SurfaceStats, classical_mds, grad_sums, js_sums
from headlab.interpret.probing.probe_result import MEASURES, ProbeResult
from headlab.interpret.probing.treebank import Skipped, Treebank, read_treebank
from headlab.progress import Progress, reporter

BATCH_BYTES = 192 << 20  # the captured maps of one batch (float32, every layer and head)
MAX_BATCH = 256
HEAD_MAP_SENTENCES = 100
HEAD_MAP_BUDGET = 100_000_000  # K^2 * t * rows elements over the head-map sentences (the JS cost)
GRAD_SENTENCES = 50


def _silent(stage: str, done: int, total: int) -> None:
    """The progress callback of ranks other than 0 (one bar, on rank 0)."""


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
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
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
        out[layer, :n] = x[start:start + n]
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
        raise InputError(f"relation{'s' if len(missing) > 1 else ''} {', '.join(repr(m) for m in missing)} "
                         f"{'do' if len(missing) > 1 else 'does'} not occur in {treebank.path}"
                         f"{' (subtypes folded)' if treebank.fold_subtypes else ''}; it has: {', '.join(known)}")
    return [r for r in known if r in wanted]


def _loss_kind(model) -> str | None:
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")) or name == "Transformer":
        return "causal-lm"
    if name.endswith(("ForMaskedLM", "ForPreTraining")):
        return "masked-lm"
    if name.endswith("ForSequenceClassification"):
        return "classifier"
    return None


def resolve_loss_model(loaded, loss_model) -> tuple[object | None, str]:
    """The model whose loss the gradient test differentiates, and a sentence saying which loss."""
    from headlab.models.cache import cache_dir
    from headlab.models.loader import LoadedModel, load

    if loss_model is None:
        return None, "gradient test not run (loss_model=None)"
    if loss_model == "auto":
        if _loss_kind(loaded.model) is not None:
            chosen = loaded
        else:
            sst2 = cache_dir("minilm-sst2")
            if loaded.name == "minilm" and (sst2 / "config.json").is_file():
                chosen = load(sst2)
            else:
                return None, (f"gradient test not run: {loaded.name} ({type(loaded.model).__name__}) has no head that "
                              "defines a loss (no LM or classification head); pass loss_model= a model of the same "
                              "shape that has one, e.g. the fine-tuned SST-2 classifier")
    elif isinstance(loss_model, LoadedModel):
        chosen = loss_model
    else:
        chosen = load(loss_model)
    kind = _loss_kind(chosen.model)
    if kind is None:
        raise ModelError(f"loss_model {chosen.name} ({type(chosen.model).__name__}) has no LM or classification head, "
                         "so it defines no loss to differentiate")
    if chosen.adapter.layer_heads != loaded.adapter.layer_heads:
        raise ModelError(f"loss_model {chosen.name} has heads per layer {chosen.adapter.layer_heads}, "
                         f"the probed model {loaded.adapter.layer_heads}; they must match")
    what = {"causal-lm": "next-token cross-entropy (the model's own LM loss)",
            "masked-lm": "masked-LM cross-entropy of every token, no token masked",
            "classifier": "cross-entropy of the classifier against its own predicted label (the treebank has no "
                          "labels for its task)"}[kind]
    return chosen, f"d loss / d attention from {chosen.name}: {what}"


def _loss_fn(kind: str, ids: torch.Tensor, mask: torch.Tensor):
    def scalar(out):
        logits = out.logits.float()
        if kind == "classifier":
            return torch.nn.functional.cross_entropy(logits, logits.argmax(-1).detach(), reduction="sum")
        if kind == "causal-lm":
            logits, target, m = logits[:, :-1], ids[:, 1:], mask[:, 1:].float()
        else:
            target, m = ids, mask.float()
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # (B, T)
        return ((ce * m).sum(1) / m.sum(1).clamp(min=1)).sum()  # each sentence's mean, summed
    return scalar


def _gradient_test(chosen, sentences, causal: bool, budget: int, backend, say) -> dict[str, np.ndarray]:
    kind = _loss_kind(chosen.model)
    heads = chosen.adapter.layer_heads
    K = sum(heads)
    items, _ = al.align_sentences(chosen.tokenizer, sentences, max_positions=chosen.max_positions)
    total = len(items)
    items = [items[i] for i in chosen.adapter.placement.examples(total)]  # data-parallel under torchrun (by groups of
    # a sharded model's ranks, which make the same forwards), as the main pass
    sums = [torch.zeros(K, dtype=torch.float64) for _ in range(3)]
    counts = [0.0, 0.0, 0.0]
    batches = _batches(items, K * 4, budget)  # autograd keeps activations: smaller batches
    done = 0
    params = [p for p in chosen.model.parameters() if p.requires_grad]
    for p in params:  # only d loss / d attention is wanted: no weight gradients (half the backward)
        p.requires_grad_(False)
    try:
        for group in batches:
            done = _gradient_batch(chosen, group, kind, causal, backend, sums, counts, done)
            say("gradients", done, len(items))
    finally:
        for p in params:
            p.requires_grad_(True)
    *sums, counts = chosen.adapter.placement.sum_over_data([*sums, counts])
    return {name: _on_grid((sums[i] / max(float(counts[i]), 1.0)).numpy(), heads)
            for i, name in enumerate(("grad_sep", "grad_other", "grad_first"))}


def _gradient_batch(chosen, group, kind, causal, backend, sums, counts, done) -> int:
    """One batch of the gradient test: add its |d loss / d attention| sums into ``sums``, ``counts``."""
    L = chosen.adapter.n_layers
    pad = chosen.tokenizer.pad_token_id if chosen.tokenizer.pad_token_id is not None else 0
    b = al.make_batch(group, {}, pad)
    cache = capture(chosen, {"input_ids": b.input_ids, "attention_mask": b.attention_mask},
                    chosen.adapter.sites("pattern"), grads=True, scalar=_loss_fn(kind, b.input_ids, b.attention_mask),
                    backend=backend)
    g = torch.cat([cache.grads[chosen.adapter.site_name(i, "pattern")] for i in range(L)], dim=1)  # (B, K, T, T)
    valid = b.attention_mask.bool()
    sink = b.sep.clone() if not causal else torch.zeros_like(valid)
    if causal or not sink.any():  # decoders (and encoders without [SEP]): the first token is the sink
        sink[:, 0] = True
    s_sink, n_sink, s_other, n_other = grad_sums(g, valid, sink, causal=causal)
    sums[0] += s_sink
    sums[1] += s_other
    counts[0] += n_sink
    counts[1] += n_other
    first = torch.zeros_like(valid)
    first[:, 0] = True  # [CLS] (an encoder's other sink) or a decoder's first token
    s_first, n_first, _, _ = grad_sums(g, valid, first, causal=causal)
    sums[2] += s_first
    counts[2] += n_first
    return done + len(group)


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

    Returns:
        :class:`~headlab.interpret.probing.probe_result.ProbeResult`.
    """
    from headlab.models.loader import LoadedModel, load

    t0 = time.perf_counter()
    with reporter(progress) as say:  # the one display (headlab.progress)
        for name, v in (("head_map_sentences", head_map_sentences), ("grad_sentences", grad_sentences)):
            if v < 0:
                raise InputError(f"{name} must be 0 or more, got {v}")
        tb = (treebank_path if isinstance(treebank_path, Treebank) else  # already read (the probe instrument)
              read_treebank(treebank_path, fold_subtypes=fold_subtypes, limit=limit))  # bad input first, then the model
        names = choose_relations(tb, relations)
        if not isinstance(loaded, LoadedModel):
            loaded = load(loaded)
        al.check_fast(loaded.tokenizer, loaded.name)
        rel_index = {r: i for i, r in enumerate(names)}
        chosen, grad_note = (resolve_loss_model(loaded, loss_model) if grad_sentences else
                             (None, "gradient test not run (grad_sentences=0)"))

        adapter = loaded.adapter
        L, H, heads = adapter.n_layers, adapter.n_heads, adapter.layer_heads  # a pruned model's layers may differ
        K, R = sum(heads), len(names)
        causal = _is_causal(loaded)
        items, align_skips = al.align_sentences(loaded.tokenizer, tb.sentences, max_positions=loaded.max_positions)
        skipped = list(tb.skipped) + [Skipped(i, why) for i, why in align_skips]
        if not items:
            raise InputError(f"no sentence of {tb.path} can be probed with {loaded.name}: "
                             f"{skipped[0].sent_id}: {skipped[0].reason}" if skipped else "no sentence")
        map_ids = {id(a) for a in items[:head_map_sentences]}
        mean_t = float(np.mean([a.n_tokens for a in items[:head_map_sentences]])) if head_map_sentences else 1.0
        rows_each = max(1, int(head_map_budget / (K * K * mean_t * max(1, min(head_map_sentences, len(items))))))
        pad = getattr(loaded.tokenizer, "pad_token_id", None)
        pad = 0 if pad is None else pad

        correct = torch.zeros(2, K, R)
        gold = GoldCounts(np.zeros((2, R)), np.zeros((2, R)), np.zeros((2, len(OFFSETS), R)))
        surface = SurfaceStats(K)
        js = torch.zeros(K, K, dtype=torch.float64)
        js_rows = 0.0
        notes: list[str] = []
        done, n_tokens, in_map = 0, 0, 0
        # under torchrun each rank takes every W-th sentence and the sums are added (identity on one process); the
        # ranks of a model sharded by tensor parallelism run the same sentences (the captures are gathered)
        mine = [items[i] for i in loaded.adapter.placement.examples(len(items))]
        if not is_main():
            say = _silent
        say("sentences", 0, len(mine))
        try:
            with torch.inference_mode():
                for group in _batches(mine, K, batch_bytes):
                    b = al.make_batch(group, rel_index, pad)
                    att = _patterns(loaded, b, backend)  # (B, K, T, T)
                    valid = b.attention_mask.bool()
                    pred = al.predict(al.word_attention(att, b.a_to), b.candidates)  # (B, K, N)
                    correct += al.score(pred, b, R)
                    gold += gold_counts([a.sentence for a in group], rel_index)
                    surface.add(att, valid, b.sep, b.punct)
                    for k, a in enumerate(group):
                        if id(a) in map_ids:
                            t = a.n_tokens
                            # evenly spaced from the last row back (a decoder's first row is all on token 0)
                            rows = np.unique(np.linspace(t - 1, 0, min(t, rows_each) + 1)[:min(t, rows_each)].round()
                                             .astype(int))
                            js += js_sums(att[k, :, rows, :t])
                            js_rows += len(rows)
                            in_map += 1
                    done += len(group)
                    n_tokens += int(valid.sum())
                    say("sentences", done, len(mine))
        except KeyboardInterrupt:
            notes.append(f"interrupted after {done} of {len(items)} sentences: the figures cover those")
        # the sums of every rank (one message; nothing changes on one process)
        sums = loaded.adapter.placement.sum_over_data([
            correct, gold.count, gold.visible, gold.correct, js, *surface.sums.values(),
            [surface.n_query, surface.n_pairs, float(surface.any_sep), js_rows, done, n_tokens, in_map]])
        correct, js = sums[0].float(), sums[4]
        gold = GoldCounts(sums[1].numpy(), sums[2].numpy(), sums[3].numpy())
        surface.sums = dict(zip(surface.sums, sums[5:-1]))
        surface.n_query, surface.n_pairs, any_sep, js_rows, done, n_tokens, in_map = sums[-1].tolist()
        surface.any_sep = any_sep > 0
        done, n_tokens, in_map = int(done), int(n_tokens), int(in_map)
        if done == 0:
            raise KeyboardInterrupt

        per_head = {k: np.full((L, H), np.nan) for k in MEASURES}
        for k, v in surface.means().items():
            per_head[k] = _on_grid(v, heads)
        if chosen is not None and not notes:
            per_head.update(_gradient_test(chosen, [a.sentence for a in items[:grad_sentences]], causal,
                                           batch_bytes, backend, say))
            grad_note += f" ({min(grad_sentences, len(items))} sentences)"
        head_map = None
        if in_map >= 1 and js_rows:
            head_map = _on_grid(classical_mds(np.sqrt((js / js_rows).numpy())), heads).reshape(L * H, 2)

        count = gold.count
        acc = _on_grid(correct.numpy() / np.maximum(count[:, None, :], 1), heads, axis=1)  # (2, L, H, R)
        base = gold.correct / np.maximum(count[:, None, :], 1)  # (2, O, R)
        best = base.argmax(1)
        offsets = np.asarray(OFFSETS)[best]
        base_acc = np.take_along_axis(base, best[:, None, :], 1)[:, 0]
        if causal:
            notes.append("causal model: a word sees only earlier words, so dep->head can be right only when the head "
                         "comes first and head->dep only when a dependent does (the 'visible' share of each relation)")
        return ProbeResult(
            model=loaded.name, family=loaded.family, causal=causal, treebank=tb.path, n_layers=L, n_heads=H,
            sentences=done, tokens=n_tokens, relation_names=names, accuracy=acc, count=count, visible=gold.visible,
            baseline_accuracy=base_acc, baseline_offset=offsets, per_head=per_head, skipped=skipped,
            head_map=head_map, head_map_sentences=in_map, grad_note=grad_note, seconds=time.perf_counter() - t0,
            notes=notes, fold_subtypes=fold_subtypes, min_count=min_count)


__all__ = ["BATCH_BYTES", "choose_relations", "probe", "resolve_loss_model"]
