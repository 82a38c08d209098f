"""Retrieval: associative recall in words (the key-value recall of Fu et al. 2023's H3 and Arora et al. 2023's
Zoology, with names as keys and cities as values)."""

from __future__ import annotations

import random

import torch

from headlab.errors import InputError
from headlab.interpret.circuits.tasks.base import (
    PairMetric,
    TaskPairs,
    check_n,
    check_seed,
    max_draws,
    pair_logit_diff,
    single_token,
    text_tokenizer,
    too_few,
)
from headlab.interpret.circuits.tasks.ioi import NAMES
from headlab.interpret.patching.prompts import prompt_pair

CITIES = [
    "Paris",
    "Rome",
    "Berlin",
    "Tokyo",
    "London",
    "Madrid",
    "Vienna",
    "Dublin",
    "Oslo",
    "Cairo",
    "Boston",
    "Chicago",
    "Sydney",
    "Moscow",
    "Athens",
    "Prague",
]
# the paraphrases: what joins the "key value" facts, and the facts to the query key
SEPARATORS = [". ", ", ", " and "]
FACTS = 3  # key-value facts per prompt: 12 tokens on SmolLM2, so 64 pairs run quickly


def retrieval(model, n: int = 64, *, seed: int = 0) -> TaskPairs:
    """Associative recall: three "key value" facts, then one key again; the model is to recall its value.

    Clean: ``"Emily Moscow. Michael Paris. Richard London. Michael"`` -> ``" Paris"``; the facts are joined by
    one of :data:`SEPARATORS` (``". "``, ``", "``, ``" and "``: ``TaskPairs.template``, taken in turn). Keys
    are names, values cities, each one token after a space and all different in a prompt. Corrupted: the
    query names another key of the context (one token, so the lengths agree), whose value ``V'`` becomes
    the answer. Metric: ``logit(V) - logit(V')`` at the last real token. About 12 tokens a prompt on SmolLM2.

    This is the associative-recall task of Fu et al. 2023 (H3) and Arora et al. 2023 (Zoology, MQAR) in
    words. The value follows its key directly, as there: with a phrase between them ("The code of Anna is
    4. ... The code of Ben is") SmolLM2-135M recalls nothing (clean and corrupted logit differences both
    about -0.3 on 16 pairs), so that task would have no gap to patch.

    Raises:
        ConfigError: a bad ``n`` or ``seed``. ModelError: a model without a tokenizer.
        InputError: fewer than 3 names or cities that the tokenizer keeps as one token (named).
    """
    check_n(n)
    tok = text_tokenizer(model, "retrieval")
    keys_ok = [w for w in NAMES if single_token(tok, w)]
    values_ok = [w for w in CITIES if single_token(tok, w)]
    for what, have, pool in (("names", keys_ok, NAMES), ("cities", values_ok, CITIES)):
        if len(have) < FACTS:
            raise InputError(
                f"retrieval needs {FACTS} {what} that the tokenizer keeps as one token after a space; it "
                f"keeps {have} and splits or lacks {[w for w in pool if w not in have][:8]}: use a model "
                "whose vocabulary has them"
            )
    rng = random.Random(check_seed(seed))
    kept: list[tuple[str, str, str, str, int]] = []
    tried = 0
    while len(kept) < n:
        if tried >= max_draws(n):
            raise too_few("retrieval", len(kept), n, tried, "clean and corrupted prompts of different lengths")
        k = len(kept) % len(SEPARATORS)
        sep = SEPARATORS[k]
        keys, values = rng.sample(keys_ok, FACTS), rng.sample(values_ok, FACTS)
        q, q2 = rng.sample(range(FACTS), 2)
        tried += 1
        context = sep.join(f"{key} {v}" for key, v in zip(keys, values)) + sep
        clean, corrupt = context + keys[q], context + keys[q2]
        if len(tok(clean)["input_ids"]) == len(tok(corrupt)["input_ids"]):
            kept.append((clean, corrupt, " " + values[q], " " + values[q2], k))
    cleans, corrupts, right, wrong, ks = (list(x) for x in zip(*kept))
    a, b, _ = prompt_pair(model, cleans, corrupts, right, wrong)
    last = a["attention_mask"].sum(-1).cpu() - 1
    metric = PairMetric(
        "logit_diff",
        pair_logit_diff,
        {
            "correct": torch.tensor([tok(w, add_special_tokens=False)["input_ids"][0] for w in right]),
            "wrong": torch.tensor([tok(w, add_special_tokens=False)["input_ids"][0] for w in wrong]),
            "position": last,
        },
    )
    return TaskPairs(
        "retrieval",
        a,
        b,
        metric,
        ks,
        f"associative recall (Fu et al. 2023, Arora et al. 2023) in words: {FACTS} 'name city' facts then "
        "one name again, corrupted by querying another name of the context; metric logit(V) - logit(V') "
        "at the last token",
    )
