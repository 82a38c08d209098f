"""``headlab.atlas(model)``: score every head on every kind, then check each label causally.

Passes, each recorded once (:func:`headlab.capture` of q, k and the map-free statistics):

1. repeated random tokens -> previous_token, duplicate_token, induction (:mod:`.scores`); the OV copying
   score from the weights alone;
2. natural text -> sink, local, and the pattern labels of :mod:`headlab.interpret.heads.labels`;
3. needle-in-a-haystack decoding (decoders) -> retrieval (:mod:`.retrieval`);
4. a treebank, when given -> syntactic (the probe, :func:`headlab.probe`), with each head's relation of
   largest margin for the syntactic check (:mod:`.dependents`);
5. the causal checks (:mod:`.causal`) of every scored kind with a task.

Under torchrun (``torchrun --nproc-per-node N -m headlab atlas ...``) the needle trials and the checks'
configurations are split over the ranks and gathered back, which gives the one-process result; the
score passes are small and run on every rank. With ``resume=``, finished phases survive an interrupt.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence

import torch

from headlab.distributed.data import gather_objects, shard_indices
from headlab.errors import ConfigError, InputError
from headlab.interpret.atlas import scores as S
from headlab.interpret.atlas import tasks as T
from headlab.interpret.atlas.result import KINDS, Atlas, Thresholds
from headlab.interpret.atlas.resume import Checkpoint, encode, fingerprint
from headlab.interpret.atlas.retrieval import retrieval_trial
from headlab.interpret.capture import capture
from headlab.interpret.heads import labels as LB
from headlab.models.loader import load, resolve

TASKS = {"previous_token": "loss on the repeated half", "duplicate_token": "loss on the repeated half",
         "induction": "loss on the repeated half", "retrieval": "needle accuracy (teacher-forced)",
         "sink": "log-perplexity of real text", "local": "log-perplexity of real text",
         "syntactic": "loss on the treebank words in the top heads' relations"}


def _grid(adapter) -> torch.Tensor:
    return torch.full((adapter.n_layers, adapter.n_heads), float("nan"), dtype=torch.float64)


def _kinds(kinds, adapter, treebank, has_logits: bool) -> tuple[list[str], dict[str, str]]:
    """The kinds to score and, for the default set, those left out with the reason; an explicit
    request the model cannot serve is refused before any work."""
    why = {}
    if not adapter.causal or not has_logits:
        why["retrieval"] = "needs a decoder with a language-model head (greedy decoding)"
    if treebank is None:
        why["syntactic"] = "needs a treebank (treebank=FILE.conllu)"
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


def _say(progress):
    if progress is None or progress is False:
        return lambda stage, done, total: None
    return progress


def _capture_qk(adapter, ids: torch.Tensor, stats_kwargs: dict | None = None):
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    sites = adapter.sites("q") + adapter.sites("k") + adapter.sites("stats")
    return capture(adapter, inputs, sites, stats_kwargs=stats_kwargs)


def _layer(cache, adapter, layer: int):
    return (cache[adapter.site_name(layer, "q")], cache[adapter.site_name(layer, "k")], cache.call_args[layer])


def _repeated_scores(adapter, ids, start, half, out: dict) -> None:
    cache = _capture_qk(adapter, ids, {"stats": ["lse"]})  # the rows' full log-normalisers, in the forward
    for layer in range(adapter.n_layers):
        q, k, ca = _layer(cache, adapter, layer)
        full = cache[adapter.site_name(layer, "stats")].lse
        for name, v in S.repeated_score(q, k, ca, start=start, half=half, full=full).items():  # (B, H_l)
            out[name][layer, :v.shape[1]] = v.double().mean(0)


def _sinks(tokenizer, ids: torch.Tensor, causal: bool) -> list[int]:
    sep = getattr(tokenizer, "sep_token_id", None)
    if causal or sep is None:
        return [0]
    return [0] + [i for i, t in enumerate(ids.tolist()) if t == sep and i > 0]


def _text_scores(adapter, tokenizer, pieces, window: int, sums: dict, thresholds) -> list[list[list[str]]]:
    """Sink and local mass per head (mean over rows, then pieces) and the pattern labels of the first piece."""
    labels: list[list[list[str]]] = []
    for n, ids in enumerate(pieces):
        sinks = _sinks(tokenizer, ids, adapter.causal)
        cache = _capture_qk(adapter, ids[None], {"key_positions": sinks})
        rows = []
        for layer in range(adapter.n_layers):
            q, k, ca = _layer(cache, adapter, layer)
            st = cache[adapter.site_name(layer, "stats")]
            H = q.shape[1]
            sums["sink"][layer, :H] += st.key_mass[0].sum(-1).mean(-1).double()
            sums["local"][layer, :H] += S.window_mass(q, k, ca, window, causal=adapter.causal,
                                                      full=st.lse)[0].mean(-1).double()
            rows.append(LB.row_stats_from_attention_stats(st, sink_positions=sinks, causal=adapter.causal))
        if n == 0:
            toks = (tokenizer.convert_ids_to_tokens(ids.tolist()) if tokenizer is not None
                    else [str(t) for t in ids.tolist()])
            recs = LB.head_records(rows, toks, separator_positions=None if adapter.causal or len(sinks) == 1
                                   else sinks[1:], thresholds=thresholds)
            labels = [[[] for _ in range(adapter.n_heads)] for _ in range(adapter.n_layers)]
            for r in recs:
                labels[r.layer][r.head] = list(r.labels)
    for kind in ("sink", "local"):
        sums[kind] /= len(pieces)
    return labels


def _syntactic(loaded, treebank, limit, grid) -> tuple[dict[str, list[str]], list[str], torch.Tensor, dict[str, str]]:
    """The probe's scores: ``(relations each head is best for, notes, grid of margins, each head's relation
    of largest margin)``."""
    from headlab.interpret.atlas.dependents import head_relations
    from headlab.interpret.probing import probe

    r = probe(loaded, treebank, limit=limit, head_map_sentences=0, grad_sentences=0, loss_model=None)
    acc = torch.as_tensor(r.accuracy - r.baseline_accuracy[:, None, None, :])  # (2, L, H, R)
    ok = torch.as_tensor(r.count >= r.min_count if hasattr(r, "min_count") else r.count > 0)
    margin = torch.where(ok[:, None, None, :] & ~torch.isnan(acc), acc, torch.tensor(-math.inf, dtype=acc.dtype))
    best = margin.amax(dim=(0, 3))
    grid[:best.shape[0], :best.shape[1]] = torch.where(torch.isinf(best), torch.nan, best).double()
    rel: dict[str, list[str]] = {}
    for b in r.best_heads:
        if b.margin > 0 and b.count >= r.min_count:
            rel.setdefault(f"{b.layer}.{b.head}", []).append(
                f"{b.relation} {b.direction} {b.accuracy:.0%} (baseline {b.baseline_accuracy:.0%})")
    return rel, [f"syntactic: {r.sentences} sentences of {r.treebank}"], grid, head_relations(margin, r.relation_names)


def atlas(model, *, kinds: Sequence[str] | str | None = None, texts=None, treebank=None, treebank_limit: int = 200,
          checks: bool = True, copying: bool = True, k: int | None = None, n_draws: int = 10, half: int = 50,
          n_repeated: int = 8,
          window: int = 16, max_tokens: int = 128, n_texts: int = 4, needle_trials: int = 4,
          haystack_tokens: int = 256, n_boot: int = 1000, seed: int = 0, max_rows: int = 32,
          thresholds: Thresholds = Thresholds(), progress: Callable | None = None, resume=None,
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
        progress: ``progress(stage, done, total)``.
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
    todo, skipped = _kinds(kinds, adapter, treebank, has_logits)
    for name, v, lo in (("n_draws", n_draws, 1), ("half", half, 2), ("n_repeated", n_repeated, 2),
                        ("n_texts", n_texts, 1), ("needle_trials", needle_trials, 1), ("n_boot", n_boot, 2),
                        ("window", window, 2), ("max_tokens", max_tokens, 8), ("haystack_tokens", haystack_tokens, 8),
                        ("max_rows", max_rows, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{name} must be an integer of at least {lo}, got {v!r}")
    total = sum(adapter.layer_heads)
    k = k if k is not None else max(1, min(10, round(0.05 * total)))
    if not isinstance(k, int) or not 1 <= k < total:
        raise ConfigError(f"k (heads gated per check) must be an integer in 1..{total - 1}, got {k!r}")
    if treebank is not None and loaded is None:
        raise InputError("the syntactic kind needs a model with a tokenizer (headlab.load(...)) for the treebank")
    vocab = S.embeddings(adapter.model)[0].shape[0]
    say = _say(progress)
    pieces = T.natural(tok, texts, max_tokens=max_tokens, n=n_texts) if {"sink", "local", "retrieval"} & set(todo) \
        else []
    if checks and {"sink", "local"} & set(todo) and len(pieces) < 2:
        raise InputError(f"the sink and local checks need at least 2 pieces of text for their bootstrap; the texts "
                         f"give {len(pieces)} of at most {max_tokens} tokens: give more text, or a smaller max_tokens")
    if checks and "retrieval" in todo and needle_trials < 2:
        raise ConfigError("the retrieval check needs needle_trials >= 2 for its bootstrap interval")
    seconds, notes = {}, []
    sizes = {"k": k, "n_draws": n_draws, "half": half, "n_repeated": n_repeated, "window": window,
             "max_tokens": max_tokens, "n_texts": len(pieces), "needle_trials": needle_trials,
             "haystack_tokens": haystack_tokens, "seed": seed, "n_boot": n_boot, "treebank_limit": treebank_limit}
    ck = Checkpoint(resume, {"model": getattr(loaded, "name", None) or type(adapter.model).__name__,
                             "heads": adapter.layer_heads, "kinds": todo, "checks": checks, "copying": copying,
                             "texts": fingerprint(texts), "treebank": str(treebank), **sizes})
    grids = {kind: _grid(adapter) for kind in todo}
    ids_rep, start = T.repeated(tok, vocab=vocab, n=n_repeated, half=half, seed=seed)
    t0 = time.perf_counter()
    if {"previous_token", "duplicate_token", "induction"} & set(todo):
        say("repeated tokens", 0, 1)

        def repeated_phase():
            tmp = {name: _grid(adapter) for name in ("previous_token", "duplicate_token", "induction")}
            _repeated_scores(adapter, ids_rep, start, half, tmp)
            return tmp

        grids.update({n: g for n, g in ck.run("repeated", repeated_phase).items() if n in todo})
        say("repeated tokens", 1, 1)
    copying_grid = ck.run("copying", lambda: S.ov_copying(adapter).double()) if copying else None
    seconds["repeated"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    labels = []
    if {"sink", "local"} & set(todo) or pieces:
        say("natural text", 0, 1)

        def text_phase():
            tmp = {"sink": torch.zeros(adapter.n_layers, adapter.n_heads, dtype=torch.float64),
                   "local": torch.zeros(adapter.n_layers, adapter.n_heads, dtype=torch.float64)}
            tmp["labels"] = _text_scores(adapter, tok, pieces, window, tmp, LB.LabelThresholds())
            return tmp

        got = ck.run("text", text_phase)
        labels = got["labels"]
        for kind in ("sink", "local"):
            if kind in todo:
                grids[kind] = _mask_missing(adapter, got[kind])
        say("natural text", 1, 1)
    seconds["natural_text"] = time.perf_counter() - t0
    trials, retrieval_runs = [], []
    if "retrieval" in todo:
        t0 = time.perf_counter()
        trials = T.needles(tok, texts=texts, n=needle_trials, haystack_tokens=haystack_tokens, seed=seed, vocab=vocab)
        acc = torch.zeros(adapter.n_layers, adapter.n_heads, dtype=torch.float64)
        mine, runs = shard_indices(len(trials)), {}  # under torchrun each rank decodes every W-th trial
        for n, i in enumerate(mine):
            say("needle decoding", n, len(mine))
            runs[i] = ck.run(f"needle {i}", lambda tr=trials[i]: retrieval_trial(adapter, tr))
        for part in gather_objects(runs):
            runs.update(part)
        for i in range(len(trials)):
            if ck.get(f"needle {i}") is None:
                ck.put(f"needle {i}", encode(runs[i]))
            run = dict(runs[i])
            acc += run.pop("score")
            retrieval_runs.append(run)
        grids["retrieval"] = _mask_missing(adapter, acc / len(trials))
        say("needle decoding", len(trials), len(trials))
        seconds["retrieval"] = time.perf_counter() - t0
    syntactic, syntax = {}, None
    if "syntactic" in todo:
        t0 = time.perf_counter()
        say("treebank probe", 0, 1)
        syntactic, more, grids["syntactic"], best = ck.run("syntactic", lambda: _syntactic(
            loaded, treebank, treebank_limit, grids["syntactic"]))
        syntax = {"treebank": treebank, "limit": treebank_limit, "max_positions": loaded.max_positions,
                  "relations": best}
        notes += more
        seconds["syntactic"] = time.perf_counter() - t0
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
                   scores=scores, thresholds=thresholds.as_dict(), labels=labels, syntactic=syntactic,
                   skipped=skipped, notes=notes,
                   settings={**sizes, "start": start, "texts": "given" if texts is not None else "shipped passage",
                             "needle_runs": retrieval_runs})
    if checks:
        t0 = time.perf_counter()
        from headlab.interpret.atlas.checks import run_checks

        run_checks(result, adapter, tok, todo, k=k, n_draws=n_draws, pieces=pieces, trials=trials, vocab=vocab,
                   seed=seed, n_boot=n_boot, max_rows=max_rows, say=say, has_logits=has_logits, syntax=syntax,
                   checkpoint=ck)
        seconds["checks"] = time.perf_counter() - t0
    if ck.resumed:
        result.notes.append(f"resumed: {', '.join(ck.resumed)} read back from {ck.path} (their seconds are not counted)")
    if ck.stale:
        result.notes.append(f"{ck.path} held another run's phases (other settings); they were replaced")
    if evidence:
        from headlab.interpret.atlas.evidence import REPEATED_KINDS, TEXT_KINDS, evidence_maps

        short = T.repeated(tok, vocab=vocab, n=1, half=min(half, 12), seed=seed)[0][0]
        name = (lambda t: tok.convert_ids_to_tokens(t)) if tok is not None else str
        result.evidence = evidence_maps(adapter, {kd: result.top(kd, k) for kd in todo
                                                  if kd in REPEATED_KINDS + TEXT_KINDS},
                                        repeated_ids=short, text_ids=pieces[0][:24] if pieces else None, tokens=name)
    ck.finish()
    result.seconds = {n: round(s, 3) for n, s in seconds.items()}
    return result


def _mask_missing(adapter, grid: torch.Tensor) -> torch.Tensor:
    out = grid.clone()
    for layer, n in enumerate(adapter.layer_heads):
        out[layer, n:] = float("nan")
    return out


__all__ = ["TASKS", "atlas"]
