"""What several kinds share: one recording of each of the atlas's two score inputs, and the causal tasks on them.

- :func:`repeated_grid`: the random tokens repeated once (:func:`headlab.interpret.atlas.tasks.repeated`), recorded once (every
  layer's queries, keys and rows' log-normalisers), a kind's per-layer score on them meaned over sequences;
  on a model sharded by tensor parallelism each rank records and scores its own heads, and the grids are added
  over the group (the same for :func:`text_grid`);
- :func:`text_grid`: each natural-text piece recorded once (queries, keys, the map-free statistics with the
  mass on the sinks: the first token, or [CLS] and every [SEP]), a kind's per-piece score meaned over pieces;
  :func:`pattern_labels`: the pattern labels of :mod:`headlab.interpret.heads.labels` on the first piece;
- :data:`REPEATED_LOSS`: the loss on the second copy of fresh repeated sequences (decoders with a
  language-model head); :data:`TEXT_LOSS`: the log-perplexity of the natural-text pieces, or ``1 - cos`` of a
  sentence encoder's mean-pooled embedding against the ungated one.

Kinds that read one input (``Kind.reads``) are scored from its one recording; a kind of its own input
builds it in its score (retrieval's needles, syntactic's treebank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from headlab.errors import InputError
from headlab.interpret.atlas import causal as CK
from headlab.interpret.atlas import tasks as T
from headlab.interpret.atlas.checks import sharded_gated
from headlab.interpret.atlas.kinds.base import KINDS, Measure, Run, Task
from headlab.interpret.capture import capture
from headlab.interpret.heads import labels as LB

INPUTS = ("repeated", "text")  # the inputs recorded here, once for every kind that reads them (``Kind.reads``)


def _capture_qk(adapter, ids: torch.Tensor, stats_kwargs: dict | None = None):
    """q, k and the statistics of every layer, kept where the heads live: on a model sharded by tensor parallelism
    each rank records its own heads (``gather="none"``) and scores them; :func:`_place` and :func:`_added` put the
    per-head scores in global order."""
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    sites = adapter.sites("q") + adapter.sites("k") + adapter.sites("stats")
    return capture(adapter, inputs, sites, stats_kwargs=stats_kwargs, gather="none")


def _place(grid: torch.Tensor, cache, adapter, layer: int, v: torch.Tensor) -> None:
    """Row ``layer`` of ``grid`` at the heads ``v`` ``(heads here,)`` scores: a rank's own heads under tensor
    parallelism, else the layer's first ``len(v)`` (all of them; fewer in a pruned layer)."""
    if not adapter.placement.sharded:
        grid[layer, : v.shape[0]] = v
    else:
        heads = cache.heads(adapter.site_name(layer, "q"))
        grid[layer, heads.start : heads.stop] = v


def _added(adapter, grid: torch.Tensor) -> torch.Tensor:
    """A grid each rank filled at its own heads (zeros elsewhere), added over its tensor-parallel group (every
    group scored the same inputs); unsharded, ``grid`` itself."""
    return adapter.placement.sum_group(grid)


def _layer(cache, adapter, layer: int):
    """``(q, k, call_args, stats)`` of one layer: q ``(B, H, L, d)``, k ``(B, Hkv, L, d)`` as recorded."""
    return (
        cache[adapter.site_name(layer, "q")],
        cache[adapter.site_name(layer, "k")],
        cache.call_args[layer],
        cache[adapter.site_name(layer, "stats")],
    )


def repeated_grid(run: Run, per_layer: Callable) -> torch.Tensor:
    """``(n_layers, H)``: ``per_layer(q, k, call_args, lse) -> (B, H_l)`` on the repeated sequences, meaned over
    them (``lse`` ``(B, H_l, L)`` the rows' full log-normalisers, from the same forward)."""
    adapter = run.adapter
    ids = run.repeated_ids
    assert ids is not None  # drawn by the run before any kind measures
    cache = run.memo("repeated", lambda: _capture_qk(adapter, ids, {"stats": ["lse"]}))
    out = run.grid(0.0) if adapter.placement.sharded else run.grid()
    for layer in range(adapter.n_layers):
        q, k, ca, st = _layer(cache, adapter, layer)
        v = per_layer(q, k, ca, st.lse)  # (B, H_l): this rank's heads under tensor parallelism
        _place(out, cache, adapter, layer, v.double().mean(0))
    return _added(adapter, out)


def _sinks(tokenizer, ids: torch.Tensor, causal: bool) -> list[int]:
    sep = getattr(tokenizer, "sep_token_id", None)
    if causal or sep is None:
        return [0]
    return [0] + [i for i, t in enumerate(ids.tolist()) if t == sep and i > 0]


def _text(run: Run) -> list[tuple[torch.Tensor, list[int], object]]:
    """``(ids, sinks, recording)`` of every natural-text piece, recorded once per run."""

    def build():
        out = []
        for ids in run.pieces:
            sinks = _sinks(run.tokenizer, ids, run.adapter.causal)
            out.append((ids, sinks, _capture_qk(run.adapter, ids[None], {"key_positions": sinks})))
        return out

    return run.memo("text", build)


def text_grid(run: Run, per_piece: Callable) -> torch.Tensor:
    """``(n_layers, H)``: ``per_piece(q, k, call_args, stats) -> (H_l,)`` on one piece (batch of one), meaned
    over the pieces."""
    adapter = run.adapter
    total = run.grid(0.0)
    for _, _, cache in _text(run):
        for layer in range(adapter.n_layers):
            q, k, ca, st = _layer(cache, adapter, layer)
            part = run.grid(0.0)
            _place(part, cache, adapter, layer, per_piece(q, k, ca, st).double())
            total += part
    return run.mask_missing(_added(adapter, total) / len(run.pieces))


def pattern_labels(run: Run) -> list[list[list[str]]]:
    """``labels[l][h]``: the pattern labels of the first natural-text piece (:mod:`headlab.interpret.heads.labels`)."""
    adapter, tok = run.adapter, run.tokenizer
    ids, sinks, cache = _text(run)[0]
    stats = [_layer(cache, adapter, layer)[3] for layer in range(adapter.n_layers)]
    if adapter.placement.sharded:  # every head's statistics (rows, no maps), in global order on every rank
        names = [adapter.site_name(layer, "stats") for layer in range(adapter.n_layers)]
        got = adapter.placement.gather_sites(dict(zip(names, stats)))
        stats = [got[n] for n in names]
    rows = [LB.row_stats_from_attention_stats(st, sink_positions=sinks, causal=adapter.causal) for st in stats]
    toks = tok.convert_ids_to_tokens(ids.tolist()) if tok is not None else [str(t) for t in ids.tolist()]
    recs = LB.head_records(
        rows,
        toks,
        separator_positions=None if adapter.causal or len(sinks) == 1 else sinks[1:],
        thresholds=LB.LabelThresholds(),
    )
    labels: list[list[list]] = [[[] for _ in range(adapter.n_heads)] for _ in range(adapter.n_layers)]
    for r in recs:
        labels[r.layer][r.head] = list(r.labels)
    return labels


def _repeated_loss(run: Run, result, k: int) -> Measure:
    half, start, sz = run.sizes["half"], run.start, run.sizes
    ids, _ = T.repeated(
        run.tokenizer, vocab=run.vocab, n=sz["n_repeated"], half=half, seed=sz["seed"] + 1
    )  # not the scored ones
    inputs = {"input_ids": ids.to(run.device), "attention_mask": torch.ones_like(ids).to(run.device)}
    metric = CK.span_loss(start + half + 1, start + 2 * half)
    return Measure(
        lambda configs: sharded_gated(run.adapter, inputs, configs, metric, max_rows=run.max_rows),
        "loss on the repeated half",
        +1,
    )


REPEATED_LOSS = Task(
    "repeated",
    "loss on the repeated half",
    _repeated_loss,
    no_lm="needs a decoder with a language-model head (loss on the repeated half)",
)


def _pad(pieces: list[torch.Tensor], pad_id: int = 0) -> dict:
    L = max(len(p) for p in pieces)
    ids = torch.full((len(pieces), L), pad_id, dtype=torch.long)
    att = torch.zeros(len(pieces), L, dtype=torch.long)
    for i, p in enumerate(pieces):
        ids[i, : len(p)], att[i, : len(p)] = p, 1
    return {"input_ids": ids, "attention_mask": att}


def _cosine_metric(adapter, inputs) -> tuple:
    """``1 - cos(e, e_0)`` of the pooled embedding against the ungated model's, per row."""
    with torch.no_grad():
        ref = CK.pooled(adapter.forward(inputs), inputs)  # (B, E)

    def metric(out, rep):
        e = CK.pooled(out, rep)
        return 1.0 - F.cosine_similarity(e, ref.repeat(e.shape[0] // ref.shape[0], 1), dim=-1)

    return metric, "1 - cos of the pooled embedding (an encoder: no perplexity)"


def _text_loss(run: Run, result, k: int) -> Measure:
    pad = getattr(run.tokenizer, "pad_token_id", None) or 0
    inputs = {key: v.to(run.device) for key, v in _pad(run.pieces, pad).items()}
    if run.has_logits:
        metric, task = CK.text_loss, "log-perplexity of real text (mean next-token NLL)"
    else:
        metric, task = _cosine_metric(run.adapter, inputs)
    return Measure(lambda configs: sharded_gated(run.adapter, inputs, configs, metric, max_rows=run.max_rows), task, +1)


def _two_pieces(run: Run) -> None:
    if len(run.pieces) < 2:
        names = " and ".join(n for n, kd in KINDS.items() if kd.task is TEXT_LOSS)
        raise InputError(
            f"the {names} checks need at least 2 pieces of text for their bootstrap; the texts give "
            f"{len(run.pieces)} of at most {run.sizes['max_tokens']} tokens: give more text, or a smaller "
            "max_tokens"
        )


TEXT_LOSS = Task("text", "log-perplexity of real text", _text_loss, validate=_two_pieces)


__all__ = ["INPUTS", "REPEATED_LOSS", "TEXT_LOSS", "pattern_labels", "repeated_grid", "text_grid"]
