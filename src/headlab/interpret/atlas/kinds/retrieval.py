"""retrieval: a head that copies the needle while the model retrieves it (Wu et al. 2024).

Score: on needle-in-a-haystack prompts (:func:`headlab.interpret.atlas.tasks.needles`), decoded greedily,
the share of the answer's tokens a head copies (its top-1 key inside the needle and holding the generated
token; :mod:`headlab.interpret.atlas.retrieval`), meaned over trials. Under torchrun the trials are split
over the ranks and gathered back (on a model sharded by tensor parallelism, over its data ranks). Checked
on the teacher-forced needle accuracy. Needs a decoder with a language-model head.
"""

from __future__ import annotations

import torch

from headlab.distributed.data import gather_objects
from headlab.errors import ConfigError
from headlab.interpret.atlas import causal as CK
from headlab.interpret.atlas import tasks as T
from headlab.interpret.atlas.checks import sharded_gated
from headlab.interpret.atlas.kinds.base import Kind, Measure, Task, register
from headlab.interpret.atlas.retrieval import retrieval_trial


def _trials(run) -> list:
    """The needle prompts, built from the seed: the same for the score and for the check (resumed or not)."""
    sz = run.sizes
    return T.needles(
        run.tokenizer,
        texts=run.texts,
        n=sz["needle_trials"],
        haystack_tokens=sz["haystack_tokens"],
        seed=sz["seed"],
        vocab=run.vocab,
    )


def score(run):
    trials = _trials(run)
    acc = run.grid(0.0)
    # under torchrun each rank decodes every W-th trial; on a model sharded by tensor parallelism every rank of a
    # tensor-parallel group decodes the same trials (each forward needs the whole group), the ranks of a group
    # gather identical copies
    mine, runs = run.adapter.placement.examples(len(trials)), {}
    for n, i in enumerate(mine):
        run.say("needle decoding", n, len(mine))
        runs[i] = retrieval_trial(run.adapter, trials[i])
    for part in gather_objects(runs):
        runs.update(part)
    kept = []
    for i in range(len(trials)):
        trial = dict(runs[i])
        acc += trial.pop("score")
        kept.append(trial)
    run.settings["needle_runs"] = kept
    run.say("needle decoding", len(trials), len(trials))
    return run.mask_missing(acc / len(trials))


def _accuracy(run, result, k: int) -> Measure:
    def values(configs):
        cols = []
        for tr in _trials(run):
            ids = torch.cat([tr.ids, tr.answer])[None].to(run.device)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            cols.append(
                sharded_gated(
                    run.adapter, inputs, configs, CK.answer_accuracy(len(tr.ids), tr.answer), max_rows=run.max_rows
                )
            )
        return torch.cat(cols, 1)

    return Measure(values, "needle accuracy (teacher-forced share of the answer's tokens predicted greedily)", -1)


def _two_trials(run) -> None:
    if run.sizes["needle_trials"] < 2:
        raise ConfigError("the retrieval check needs needle_trials >= 2 for its bootstrap interval")


NEEDLE_ACCURACY = Task("needle", "needle accuracy (teacher-forced)", _accuracy, validate=_two_trials)

KIND = register(
    Kind(
        name="retrieval",
        role="retrieval",
        threshold=0.1,  # Wu et al.: "fewer than 5% of heads score above 0.1"
        score=score,
        reads="needles",
        task=NEEDLE_ACCURACY,
        letter="R",
        colour="#ff7f0e",
        unavailable=lambda run: (
            None if run.has_logits else "needs a decoder with a language-model head (greedy decoding)"
        ),
        definition="share of the needle's answer the head copies during greedy decoding (Wu et al. 2024)",
    )
)
