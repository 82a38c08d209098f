"""The atlas's causal checks, run for every scored kind with a task (see :mod:`.causal` for the rule).

Kinds that share a task share its data and one clean run: previous_token, duplicate_token and induction
gate heads on fresh repeated random sequences (the loss on the repeated half, from the second token of the
copy on, which an induction head can predict); sink and local on the natural-text pieces (log-perplexity,
or ``1 - cos`` of the pooled embedding for a sentence encoder without a language-model head); retrieval on
the needle prompts with their answers appended (teacher-forced needle accuracy); syntactic on the
treebank's sentences (the loss on the dependents of the top heads' relations, :mod:`.dependents`; decoders
with a language-model head only). Every configuration of a
group runs batched (:func:`.causal.gated`); under torchrun the configurations are split over the ranks
(:func:`sharded_gated`), which gives the one-process numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headlab.distributed.data import all_reduce_sum, shard_indices
from headlab.interpret.atlas import causal as CK
from headlab.interpret.heads.ablation import config_masks
from headlab.interpret.atlas import dependents as D
from headlab.interpret.atlas import tasks as T

GROUPS = {"repeated": ("previous_token", "duplicate_token", "induction"), "text": ("sink", "local"),
          "needle": ("retrieval",), "syntactic": ("syntactic",)}


def sharded_gated(adapter, inputs, configs, metric, *, max_rows: int) -> torch.Tensor:
    """:func:`.causal.gated` with the configurations split over torchrun's ranks (every W-th from its rank)
    and the ``(C, N)`` values added back: each configuration runs on one rank, so the sum is the
    one-process result exactly. Outside torchrun, :func:`.causal.gated` itself."""
    mine = shard_indices(configs.shape[0])
    n = int(inputs["input_ids"].shape[0])
    full = torch.zeros(configs.shape[0], n, dtype=torch.float64)
    if mine:
        full[mine] = CK.gated(adapter, inputs, configs[mine], metric, max_rows=max_rows)
    return all_reduce_sum(full)


def _pad(pieces: list[torch.Tensor], pad_id: int = 0) -> dict:
    L = max(len(p) for p in pieces)
    ids = torch.full((len(pieces), L), pad_id, dtype=torch.long)
    att = torch.zeros(len(pieces), L, dtype=torch.long)
    for i, p in enumerate(pieces):
        ids[i, :len(p)], att[i, :len(p)] = p, 1
    return {"input_ids": ids, "attention_mask": att}


def _cosine_metric(adapter, inputs) -> tuple:
    """``1 - cos(e, e_0)`` of the pooled embedding against the ungated model's, per row."""
    with torch.no_grad():
        ref = CK.pooled(adapter.forward(inputs), inputs)  # (B, E)

    def metric(out, rep):
        e = CK.pooled(out, rep)
        return 1.0 - F.cosine_similarity(e, ref.repeat(e.shape[0] // ref.shape[0], 1), dim=-1)
    return metric, "1 - cos of the pooled embedding (an encoder: no perplexity)"


def run_checks(result, adapter, tok, todo, *, k, n_draws, pieces, trials, vocab, seed, n_boot, max_rows, say,
               has_logits: bool, syntax: dict | None = None, checkpoint=None) -> None:
    """Fill ``result.verdicts`` (and ``result.skipped`` for kinds without a task on this model); with a
    :class:`~headlab.interpret.atlas.resume.Checkpoint`, each task's verdicts are kept as it finishes.

    ``syntax`` (the syntactic kind): ``treebank``, ``limit``, ``max_positions`` as the probe read the
    treebank, and ``relations``, each head's relation of largest margin (:func:`.dependents.head_relations`)."""
    device = next(adapter.model.parameters()).device
    for group, members in GROUPS.items():
        kinds = [kd for kd in members if kd in todo]
        if not kinds:
            continue
        if group in ("repeated", "syntactic") and not has_logits:
            for kd in kinds:
                result.skipped[f"{kd} check"] = (D.NO_LM if group == "syntactic" else
                                                 "needs a decoder with a language-model head (loss on the repeated half)")
            continue
        if checkpoint is not None and checkpoint.get(f"check {group}") is not None:
            result.verdicts.update(checkpoint.get(f"check {group}"))
            continue
        if group == "syntactic":
            relations = sorted({syntax["relations"][f"{l}.{h}"] for l, h in result.top("syntactic", k)
                                if f"{l}.{h}" in syntax["relations"]})
            found = D.examples(tok, syntax["treebank"], limit=syntax["limit"], relations=relations,
                               max_positions=syntax["max_positions"]) if relations else []
            if len(found) < 2:
                result.skipped["syntactic check"] = (
                    f"not run: {len(found)} treebank sentence(s) hold a dependent of the top heads' relations "
                    f"({', '.join(relations) or 'none with enough cases'}) past the first token; the bootstrap "
                    "needs at least 2 (give more sentences: treebank_limit)")
                continue
        sets = [[]]
        for i, kd in enumerate(kinds):
            top = result.top(kd, k)
            draws = CK.draw_sets(adapter.n_layers, adapter.layer_heads, top, n_draws=n_draws, seed=seed + 101 * (i + 1))
            sets += [top] + draws
        configs = config_masks(adapter, sets)
        say(f"causal checks ({group})", 0, 1)
        if group == "repeated":
            half, start = result.settings["half"], result.settings["start"]
            ids, _ = T.repeated(tok, vocab=vocab, n=result.settings["n_repeated"], half=half, seed=seed + 1)
            inputs = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
            metric, task, harm = CK.span_loss(start + half + 1, start + 2 * half), "loss on the repeated half", +1
            vals = sharded_gated(adapter, inputs, configs, metric, max_rows=max_rows)  # (C, N)
        elif group == "text":
            pad = getattr(tok, "pad_token_id", None) or 0
            inputs = {key: v.to(device) for key, v in _pad(pieces, pad).items()}
            if has_logits:
                metric, task = CK.text_loss, "log-perplexity of real text (mean next-token NLL)"
            else:
                metric, task = _cosine_metric(adapter, inputs)
            harm = +1
            vals = sharded_gated(adapter, inputs, configs, metric, max_rows=max_rows)
        elif group == "needle":
            cols = []
            for tr in trials:
                ids = torch.cat([tr.ids, tr.answer])[None].to(device)
                inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
                cols.append(sharded_gated(adapter, inputs, configs, CK.answer_accuracy(len(tr.ids), tr.answer),
                                          max_rows=max_rows))
            vals = torch.cat(cols, 1)
            task, harm = "needle accuracy (teacher-forced share of the answer's tokens predicted greedily)", -1
        else:  # syntactic: the treebank's sentences a few at a time (a language model's logits are rows x L x vocab)
            pad = getattr(tok, "pad_token_id", None) or 0
            vals = torch.cat([sharded_gated(adapter, {key: v.to(device) for key, v in inputs.items()}, configs,
                                            CK.target_loss(targets), max_rows=max_rows)
                              for inputs, targets in D.batches(found, pad_id=pad, max_rows=max_rows)], 1)
            task, harm = D.task_name(relations), +1
        say(f"causal checks ({group})", 1, 1)
        effects = harm * (vals[1:] - vals[:1])  # (C - 1, N): how much worse each configuration makes each example
        for i, kd in enumerate(kinds):
            rows = effects[i * (1 + n_draws):(i + 1) * (1 + n_draws)].numpy()
            v = CK.verdict(rows[0], rows[1:], n_boot=n_boot, seed=seed)
            v.update({"kind": kd, "task": task, "k": k, "heads": [list(x) for x in sets[1 + i * (1 + n_draws)]],
                      "draws": [[list(x) for x in s] for s in sets[2 + i * (1 + n_draws):1 + (i + 1) * (1 + n_draws)]],
                      "baseline": float(vals[0].mean()), "n_examples": int(vals.shape[1]),
                      "effects": {"targeted": rows[0].round(8).tolist(), "random": rows[1:].round(8).tolist()},
                      "evidence": _evidence(v, k)})
            if group == "syntactic":
                v.update({"relations": relations, "sentences": [e.sent_id for e in found],
                          "targets": sum(len(e.targets) for e in found)})
            result.verdicts[kd] = v
        if checkpoint is not None:
            checkpoint.put(f"check {group}", {kd: result.verdicts[kd] for kd in kinds})


def _evidence(v: dict, k: int) -> str:
    lo, hi = v["targeted_ci"]
    times = "n/a (random mean <= 0)" if v["times_random"] is None else f"{v['times_random']:.1f}x"
    return (f"{v['verdict']}: gating the top {k} raises the harm by {v['targeted']:.4g} [{lo:.4g}, {hi:.4g}]; "
            f"{len(v['random'])} random draws of {k}: mean {v['random_mean']:.4g}, largest upper end "
            f"{v['random_max_upper']:.4g}; {times} random")


__all__ = ["GROUPS", "run_checks"]
