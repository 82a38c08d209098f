"""Greater-than (Hanna, Liu and Variengien 2023, "How does GPT-2 compute greater-than?", arXiv 2305.00586)."""

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
    signed_prob,
    text_tokenizer,
    too_few,
)

GREATER_THAN = "The {noun} lasted from the year {century}{yy} to the year {century}"
CENTURY = "17"
# nouns of events that last a span of years, in the manner of Hanna et al.'s (their list is longer)
NOUNS = [
    "war",
    "siege",
    "reign",
    "rebellion",
    "occupation",
    "expedition",
    "famine",
    "drought",
    "plague",
    "truce",
    "alliance",
    "crusade",
    "voyage",
    "dynasty",
    "embargo",
    "revolt",
    "conflict",
    "dispute",
    "pilgrimage",
    "construction",
]


def _year_tokens(tok, prompt: str) -> tuple[str, list[int]]:
    """How the tokenizer continues ``prompt`` (ending in the century) with a year's last two digits:
    ``("pair", 100 ids of "00".."99")`` when each is one token (GPT-2), ``("digit", 10 ids of "0".."9")``
    when each digit is a token of its own (Llama, SmolLM2); InputError otherwise, naming the digits."""
    base = list(tok(prompt)["input_ids"])
    unk = getattr(tok, "unk_token_id", None)
    rest = {}
    for y in range(100):
        c = f"{y:02d}"
        full = list(tok(prompt + c)["input_ids"])
        pieces = tok.convert_ids_to_tokens(full[max(0, len(base) - 2) :])
        if full[: len(base)] != base:
            raise InputError(
                f"greater-than: the tokenizer merges the century {CENTURY!r} with the digits after it "
                f"({CENTURY + c!r} ends as {pieces}), so the prompt cannot end at the century; it needs "
                "year digits that tokenise apart from the century, one token per two digits (GPT-2) or "
                "per digit (Llama, SmolLM2)"
            )
        if unk is not None and unk in full[len(base) :]:
            lack = [ch for ch in dict.fromkeys(c) if tok(ch, add_special_tokens=False)["input_ids"] in ([unk], [])]
            raise InputError(
                f"greater-than: the tokenizer has no token {lack[0] if lack else c!r}: the year digits "
                f"{c!r} after {CENTURY!r} read as {pieces}, with the unknown token; it needs each of "
                "'00'..'99' or each of '0'..'9' as a token"
            )
        rest[c] = full[len(base) :]
    if all(len(r) == 1 for r in rest.values()) and len({r[0] for r in rest.values()}) == 100:
        return "pair", [rest[f"{y:02d}"][0] for y in range(100)]
    tens: dict = {}
    for c, r in rest.items():
        tens.setdefault(c[0], set()).add(r[0] if len(r) == 2 else None)
    if (
        all(len(r) == 2 for r in rest.values())
        and all(len(v) == 1 for v in tens.values())
        and len({next(iter(v)) for v in tens.values()}) == 10
    ):
        return "digit", [next(iter(tens[str(d)])) for d in range(10)]
    odd = next((c for c, r in rest.items() if len(r) != len(rest["00"])), "32")
    raise InputError(
        f"greater-than: after {prompt!r} the year's last two digits {odd!r} tokenise as "
        f"{tok.convert_ids_to_tokens(rest[odd])} and '00' as {tok.convert_ids_to_tokens(rest['00'])}; "
        "the probability difference needs every two-digit year as one token (GPT-2's '32') or every digit "
        "as one (SmolLM2's '3' '2')"
    )


def greater_than(model, n: int = 64, *, seed: int = 0) -> TaskPairs:
    """Greater-than (Hanna, Liu and Variengien 2023): ``"The war lasted from the year 17YY to the year 17"``.

    Corrupted: their "01" corruption, ``YY = "01"`` (the model can no longer tell which years are greater).
    ``TaskPairs.template`` is the index of the noun in :data:`NOUNS`. The metric depends on how the
    tokenizer writes years:

    - one token per two digits (GPT-2, Hanna et al.'s setting), ``YY`` uniform in 02..98: their probability
      difference ``sum_{y > YY} p(y) - sum_{y <= YY} p(y)`` over the 100 tokens "00".."99" that can follow
      the century at the last token.
    - one token per digit (Llama, SmolLM2: ``"1732"`` is ``"1" "7" "3" "2"``): the prompt still ends with
      the century, so the next token is the *tens* digit of the year. A single forward pass gives the tens
      digit's distribution only (the units digit would need a second pass per tens digit), so the metric is
      the probability difference marginalised to tens digits, with YY's tens digit ``d`` as the boundary:
      ``sum_{t > d} p(t) - sum_{t < d} p(t)``. Every year of a greater decade is greater, every year of a
      smaller decade is smaller; a year in YY's own decade may be either, so ``p(d)`` counts neither way.
      The exact difference is this plus ``p(d) * (P(units > YY's units | d) - P(units <= ... | d))``, so
      the metric is exact when ``p(d) = 0`` and off by at most ``p(d)`` (on SmolLM2-135M, 16 pairs: about
      0.4 of the clean run's next-digit mass sits on ``d``, 0.04 of the corrupted run's). ``YY`` is drawn from 10..89, the
      analogue of Hanna et al.'s 02..98: a decade on each side of the boundary (tens digit 0 has no smaller
      decade, 9 no greater one within the century).

    Args:
        model: a :func:`headlab.load` model of a causal language model.
        n: pairs (a positive int). seed: the draw of nouns and years.

    Raises:
        ConfigError: a bad ``n`` or ``seed``. ModelError: a model without a tokenizer.
        InputError: a tokenizer that writes years neither way, or lacks a year or digit token (named).
    """
    check_n(n)
    tok = text_tokenizer(model, "greater-than")
    mode, ids = _year_tokens(tok, GREATER_THAN.format(noun=NOUNS[0], century=CENTURY, yy="32"))
    low, high = (2, 98) if mode == "pair" else (10, 89)
    rng = random.Random(check_seed(seed))
    kept: list[tuple[str, str, int, int]] = []
    tried = 0
    while len(kept) < n:
        if tried >= max_draws(n):
            raise too_few("greater-than", len(kept), n, tried, "years that tokenise to different lengths")
        k, yy = rng.randrange(len(NOUNS)), rng.randint(low, high)
        tried += 1
        clean = GREATER_THAN.format(noun=NOUNS[k], century=CENTURY, yy=f"{yy:02d}")
        corrupt = GREATER_THAN.format(noun=NOUNS[k], century=CENTURY, yy="01")
        if len(tok(clean)["input_ids"]) == len(tok(corrupt)["input_ids"]):
            kept.append((clean, corrupt, k, yy))
    cleans, corrupts, ks, yys = (list(x) for x in zip(*kept))
    a, b = model.encode(cleans), model.encode(corrupts)
    last = a["attention_mask"].sum(-1).cpu() - 1  # (B,) the last real token: the century's last token
    years = torch.tensor(yys)[:, None]  # (B, 1)
    if mode == "pair":
        sign = torch.where(torch.arange(100)[None, :] > years, 1.0, -1.0)  # (B, 100): +1 for y > YY
        how = "p(year > YY) - p(year <= YY) over the two-digit year tokens"
    else:
        sign = torch.sign(torch.arange(10)[None, :] - years // 10).float()  # (B, 10): tens digit vs YY's
        how = (
            "p(tens digit > YY's) - p(tens digit < YY's) over the next digit (digits are single tokens; YY's own "
            "decade counts neither way)"
        )
    metric = PairMetric("prob_diff", signed_prob, {"sign": sign, "position": last}, ids=torch.tensor(ids))
    return TaskPairs(
        "greater-than",
        a,
        b,
        metric,
        ks,
        f"greater-than (Hanna et al. 2023): 'The war lasted from the year 17YY to the year 17', "
        f"corrupted YY=01; metric {how}",
    )
