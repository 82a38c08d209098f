"""IOI, indirect-object identification (Wang et al. 2022, "Interpretability in the Wild", arXiv 2211.00593)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import torch

from headlab.errors import ConfigError, InputError
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
from headlab.interpret.patching.prompts import prompt_pair

# Wang et al.'s BABA templates: [B] is the subject S, [A] the indirect object IO (the answer).
BABA = [
    "Then, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to",
    "Then, [B] and [A] had a lot of fun at the [PLACE]. [B] gave a [OBJECT] to",
    "Then, [B] and [A] were working at the [PLACE]. [B] decided to give a [OBJECT] to",
    "Then, [B] and [A] were thinking about going to the [PLACE]. [B] wanted to give a [OBJECT] to",
    "Then, [B] and [A] had a long argument, and afterwards [B] said to",
    "After [B] and [A] went to the [PLACE], [B] gave a [OBJECT] to",
    "When [B] and [A] got a [OBJECT] at the [PLACE], [B] decided to give it to",
    "When [B] and [A] got a [OBJECT] at the [PLACE], [B] decided to give the [OBJECT] to",
    "While [B] and [A] were working at the [PLACE], [B] gave a [OBJECT] to",
    "While [B] and [A] were commuting to the [PLACE], [B] gave a [OBJECT] to",
    "After the lunch, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to",
    "Afterwards, [B] and [A] went to the [PLACE]. [B] gave a [OBJECT] to",
    "Then, [B] and [A] had a long argument. Afterwards [B] said to",
    "The [PLACE] [B] and [A] went to had a [OBJECT]. [B] gave it to",
    "Friends [B] and [A] found a [OBJECT] at the [PLACE]. [B] gave it to",
]
# their ABBA twins: the first two names swapped, so IO comes first
ABBA = [t.replace("[B] and [A]", "[A] and [B]", 1) for t in BABA]
NAMES = [
    "Mary",
    "John",
    "Anne",
    "Paul",
    "Sarah",
    "James",
    "Lisa",
    "Mark",
    "Tom",
    "Kate",
    "David",
    "Laura",
    "Michael",
    "Emma",
    "Daniel",
    "Rachel",
    "Peter",
    "Alice",
    "George",
    "Susan",
    "Robert",
    "Linda",
    "Steven",
    "Helen",
    "Richard",
    "Karen",
    "Thomas",
    "Emily",
    "Andrew",
    "Jessica",
]
PLACES = ["store", "garden", "restaurant", "school", "hospital", "office", "house", "station"]
OBJECTS = ["ring", "kiss", "bone", "basketball", "computer", "necklace", "drink", "snack"]


def _ioi_templates(templates) -> list[str]:
    """The BABA templates to use: None (all of Wang et al.'s), or a list of indices into :data:`BABA` and/or
    templates of one's own in BABA form (``[B] and [A]`` once, ``[B]`` again later)."""
    if templates is None:
        return list(BABA)
    if isinstance(templates, (str, int)) or not isinstance(templates, Sequence) or not templates:
        raise ConfigError(
            f"templates must be a non-empty list of indices into BABA (0..{len(BABA) - 1}) or BABA-form "
            f"strings, got {templates!r}"
        )
    out = []
    for t in templates:
        if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(BABA):
            out.append(BABA[t])
        elif isinstance(t, str) and "[B] and [A]" in t and t.count("[A]") == 1 and t.count("[B]") == 2:
            out.append(t)
        else:
            raise ConfigError(
                f"IOI template {t!r} is neither an index into BABA (0..{len(BABA) - 1}) nor a BABA-form "
                "string: write '[B] and [A]' once and '[B]' once more later, e.g. "
                f"{BABA[0]!r}"
            )
    return out


def _ioi_stream(tokenizer, seed: int, templates=None) -> Iterator[tuple[str, str, str, str, int]]:
    """Endless ``(clean, corrupted, io, s, template id)``: BABA and ABBA alternating, templates in turn.

    The names, places and objects are the ones ``tokenizer`` keeps as one token after a space. The
    corrupted prompt is Wang et al.'s ABC: the same template with three other names, all different.
    Template ids: BABA template ``k`` is ``k``, its ABBA twin ``len(templates) + k``.
    """
    baba = _ioi_templates(templates)
    abba = [t.replace("[B] and [A]", "[A] and [B]", 1) for t in baba]
    names = [w for w in NAMES if single_token(tokenizer, w)]
    places = [w for w in PLACES if single_token(tokenizer, w)]
    objects = [w for w in OBJECTS if single_token(tokenizer, w)]
    uses = " ".join(baba)
    for what, have, pool, need in (
        ("names", names, NAMES, 5),
        ("places", places, PLACES, int("[PLACE]" in uses)),
        ("objects", objects, OBJECTS, int("[OBJECT]" in uses)),
    ):
        if len(have) < need:
            missing = [w for w in pool if w not in have]
            raise InputError(
                f"IOI needs at least {need} {what} that the tokenizer keeps as one token after a space; "
                f"it keeps {len(have)} ({have}) and splits or lacks {missing[:8]}: use a model whose "
                "vocabulary has them"
            )
    rng = random.Random(seed)
    i = 0
    while True:
        k = (i // 2) % len(baba)
        t = (abba if i % 2 else baba)[k]
        io, s, c1, c2, c3 = rng.sample(names, 5)
        place, obj = rng.choice(places or [""]), rng.choice(objects or [""])

        def fill(text, a, b, b2):  # [A] -> a, first [B] -> b, second [B] -> b2
            text = text.replace("[PLACE]", place).replace("[OBJECT]", obj).replace("[A]", a)
            return text.replace("[B]", b, 1).replace("[B]", b2, 1)

        yield fill(t, io, s, s), fill(t, c1, c2, c3), io, s, k + (len(baba) if i % 2 else 0)
        i += 1


def ioi_prompts(tokenizer, n: int, seed: int = 0, templates=None) -> list[tuple[str, str, str, str]]:
    """``n`` ``(clean, corrupted, io, s)`` text quadruples: BABA and ABBA alternating, templates in turn.

    ``io`` and ``s`` are bare names (the answer token is ``" " + io``). What ``benchmarks/bench_ioi.py``
    runs; :func:`ioi` makes pairs of them (and drops any whose two prompts tokenise to different lengths).
    """
    check_n(n)
    stream = _ioi_stream(tokenizer, check_seed(seed), templates)
    return [next(stream)[:4] for _ in range(n)]


def ioi(model, n: int = 64, *, seed: int = 0, templates=None) -> TaskPairs:
    """Indirect-object identification (Wang et al. 2022): ``n`` pairs on Wang et al.'s templates.

    Clean: ``"Then, Mary and John went to the store. John gave a drink to"`` -> ``" Mary"`` (the indirect
    object IO; the subject S is John), BABA and ABBA templates alternating. Corrupted: their ABC
    distribution, the same template with three other, all-different names. Metric: ``logit(IO) -
    logit(S)`` at each clean prompt's last real token, shape ``(B,)``.

    Args:
        model: a :func:`headlab.load` model (``.tokenizer``, ``.encode``) of a causal language model.
        n: pairs (a positive int).
        seed: the draw of names, places and objects (the same seed gives the same pairs).
        templates: None for Wang et al.'s 15 BABA templates (each with its ABBA twin), or a list of indices
            into :data:`BABA` and/or BABA-form strings. ``TaskPairs.template`` is ``k`` for BABA template
            ``k`` and ``len(templates) + k`` for its ABBA twin.

    Raises:
        ConfigError: a bad ``n``, ``seed`` or template. ModelError: a model without a tokenizer.
        InputError: fewer than 5 names (or no place or object, where a template names one) that the tokenizer
            keeps as one token.
    """
    check_n(n)
    tok = text_tokenizer(model, "ioi")
    stream = _ioi_stream(tok, check_seed(seed), templates)
    kept: list[tuple[str, str, str, str, int]] = []
    tried = 0
    while len(kept) < n:
        if tried >= max_draws(n):
            raise too_few("ioi", len(kept), n, tried, "clean and corrupted prompts of different lengths")
        clean, corrupt, io, s, k = next(stream)
        tried += 1
        if len(tok(clean)["input_ids"]) == len(tok(corrupt)["input_ids"]):
            kept.append((clean, corrupt, io, s, k))
    cleans, corrupts, ios, ss, ks = (list(x) for x in zip(*kept))
    a, b, _ = prompt_pair(model, cleans, corrupts, [" " + w for w in ios], [" " + w for w in ss])
    io_ids = torch.tensor([tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in ios])
    s_ids = torch.tensor([tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in ss])
    last = a["attention_mask"].sum(-1).cpu() - 1  # (B,) the last real token of each right-padded prompt
    metric = PairMetric("logit_diff", pair_logit_diff, {"correct": io_ids, "wrong": s_ids, "position": last})
    return TaskPairs(
        "ioi",
        a,
        b,
        metric,
        ks,
        "IOI (Wang et al. 2022): BABA/ABBA templates, corrupted by ABC (three other all-different names); "
        "metric logit(IO) - logit(S) at the last token",
    )
