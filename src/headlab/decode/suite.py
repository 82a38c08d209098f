"""A RULER-style evaluation generated in the project (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"): six kinds of task at a chosen length, deterministic from a seed, and a held-out
continuation per task for perplexity on decoded tokens. The paired statistics that compare two policies on the same
tasks are in :mod:`headlab.decode.suite_stats`.

- ``niah_single``: one needle ("One of the special magic numbers for the red door is: 4120937.") in the haystack,
  asked for by its key;
- ``niah_multikey``: four needles of four keys, one asked for (the others are distractors);
- ``niah_multivalue``: four needles of one key, all four values asked for;
- ``variable_tracking``: a chain ``VAR ABCDE = 51234``, ``VAR FGHIJ = VAR ABCDE``, ... spread through the haystack;
  every variable that holds the value is asked for;
- ``common_words``: a numbered list of words in which three appear far more often than the rest; the three asked for;
- ``qa``: a passage of facts about people ("Mara Quill lives in Dunmore.") among distractor facts; one asked for.

The haystack is headlab's fifty plain sentences about a village; the first forty are the filler, the last ten are
never in a context: a task's ``continuation`` is drawn from them (held out), so its perplexity measures the model
decoding past a compressed context, not copying it. The ``context`` is what a policy compresses (the prefill), the
``question`` comes after it (query-agnostic: :func:`headlab.generate`'s ``question=``), ending in an answer prefix.
A task is scored by the share of its ``answers`` found in the generated text (RULER's string match), and is
``correct`` when all are found.

    >>> from headlab.decode import suite
    >>> t = suite.task(None, "niah_multikey", tokens=300, seed=3)       # no tokenizer: lengths counted in words
    >>> t.kind, len(t.answers), t.answers[0] in t.context, t.score("It is " + t.answers[0] + ".")
    ('niah_multikey', 1, True, 1.0)
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from importlib import resources

import headlab.checks as checks
from headlab.decode.passkey import LABELS
from headlab.errors import ConfigError

__all__ = ["KINDS", "Task", "continuation", "haystack", "make_suite", "task"]

KINDS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words", "qa")
HELD_OUT = 10  # the haystack's last sentences, never in a context
KEYS = (*LABELS, "copper bell", "paper lamp", "wooden chest")  # passkey's multi-key labels, and three more
FIRST = ("Mara", "Tobin", "Elsa", "Ravi", "Noor", "Hugo", "Ines", "Caleb", "Yuki", "Oskar", "Lena", "Tomas")
LAST = ("Quill", "Barrow", "Fenwick", "Ashdown", "Morrow", "Pike", "Holloway", "Thorne", "Vance", "Wren")
CITIES = (
    "Dunmore",
    "Kestrel Bay",
    "Ashford",
    "Millbrook",
    "Stonehaven",
    "Larkspur",
    "Redwater",
    "Elmstead",
    "Harrowgate",
    "Brightwell",
    "Coldspring",
    "Fairhollow",
)
INTRO = "Some important information is hidden in the text below. Read it and remember it.\n\n"
NEW_TOKENS = {
    "niah_single": 12,
    "niah_multikey": 12,
    "niah_multivalue": 40,
    "variable_tracking": 24,
    "common_words": 16,
    "qa": 8,
}


@dataclass(frozen=True)
class Task:
    """One generated task: ``context`` (the prefill a policy compresses), ``question`` (asked after it, ending in
    an answer prefix), ``answers`` (each must appear in the answer), ``continuation`` (held-out text for
    perplexity), ``max_new_tokens`` (enough for the answers) and the ``seed`` that made it."""

    kind: str
    context: str
    question: str
    answers: tuple[str, ...]
    continuation: str
    max_new_tokens: int
    seed: int

    def score(self, text: str | None) -> float:
        """The share of the answers found in ``text`` (case-insensitive, as whole words)."""
        text = (text or "").lower()
        found = [re.search(r"(?<![\w])" + re.escape(a.lower()) + r"(?![\w])", text) is not None for a in self.answers]
        return sum(found) / len(found)

    def correct(self, text: str | None) -> bool:
        """All the answers are in ``text``."""
        return self.score(text) == 1.0


def haystack() -> list[str]:
    """The haystack's sentences in file order (the last :data:`HELD_OUT` are held out of every context)."""
    text = resources.files("headlab.decode").joinpath("assets", "haystack.txt").read_text(encoding="utf-8")
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


def _length(tok, text: str) -> int:
    """Tokens of ``text`` (words without a tokenizer)."""
    if tok is None:
        return len(text.split())
    return len(tok(text, add_special_tokens=False)["input_ids"])


def _fill(tok, items: list[str], tokens: int, rng: random.Random, *, pool: list[str] | None = None) -> str:
    """``items`` spread at random depths through filler sentences (drawn from ``pool``, default the haystack's
    first forty) until the whole reaches about ``tokens`` tokens; items keep their order."""
    pool = pool if pool is not None else haystack()[:-HELD_OUT]
    used: float = sum(_length(tok, " " + s) for s in items)
    filler: list[str] = []
    per = max(1.0, sum(_length(tok, " " + s) for s in pool) / len(pool))
    while used < tokens:
        s = pool[rng.randrange(len(pool))]
        filler.append(s)
        used += per
    slots = sorted(rng.randint(0, len(filler)) for _ in items)
    out: list[str] = []
    at = 0
    for item, slot in zip(items, slots):
        out += filler[at:slot] + [item]
        at = slot
    return " ".join(out + filler[at:])


def _number(rng: random.Random, used: set[str], digits: int = 7) -> str:
    while True:
        n = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if n not in used:
            used.add(n)
            return n


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for the {key} is: {value}."


def _niah(kind: str, budget: int, rng: random.Random, tok):
    used: set[str] = set()
    keys = rng.sample(KEYS, 1 if kind == "niah_single" else 4)
    if kind == "niah_multivalue":
        values = [_number(rng, used) for _ in range(4)]
        items = [_needle(keys[0], v) for v in values]
        q = (
            f"What are all the special magic numbers for the {keys[0]} mentioned in the text above? "
            f"Answer: The special magic numbers for the {keys[0]} mentioned in the text above are"
        )
        return _fill(tok, items, budget, rng), q, tuple(values)
    values = [_number(rng, used) for _ in keys]
    asked = rng.randrange(len(keys))
    items = [_needle(k, v) for k, v in zip(keys, values)]
    q = (
        f"What is the special magic number for the {keys[asked]} mentioned in the text above? "
        f"Answer: The special magic number for the {keys[asked]} mentioned in the text above is"
    )
    return _fill(tok, items, budget, rng), q, (values[asked],)


def _variables(budget: int, rng: random.Random, tok, hops: int = 3):
    names: list[str] = []
    while len(names) < 2 * (hops + 1):
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    used: set[str] = set()
    value, other = _number(rng, used, 5), _number(rng, used, 5)
    chain, decoy = names[: hops + 1], names[hops + 1 :]  # a second chain of another value: the distractor

    def lines(vs: list[str], val: str) -> list[str]:
        return [f"VAR {vs[0]} = {val}."] + [f"VAR {b} = VAR {a}." for a, b in zip(vs, vs[1:])]

    a, b = lines(chain, value), lines(decoy, other)
    items = [x for pair in zip(a, b) for x in pair]  # both chains in order, interleaved
    q = (
        f"Find all variables that are assigned the value {value} in the text above. Answer: According to the "
        f"chain of variable assignments in the text above, {hops + 1} variables are assigned the value {value}, "
        "they are:"
    )
    return _fill(tok, items, budget, rng), q, tuple(chain)


def _words() -> list[str]:
    """The haystack's distinct words of at least four letters, in order of first appearance."""
    seen: dict[str, None] = {}
    for s in haystack():
        for w in re.findall(r"[a-z]+", s.lower()):
            if len(w) >= 4:
                seen.setdefault(w, None)
    return list(seen)


def _common_words(budget: int, rng: random.Random, tok, top: int = 3):
    words = _words()
    rng.shuffle(words)
    common, rare = words[:top], words[top:]
    per_word = max(1.0, _length(tok, " ".join(f"{i + 100}. {w}" for i, w in enumerate(rare[:20]))) / 20)
    total = max(4 * top + 10, int((budget - 60) / per_word))
    n_common = max(4, total // (3 * top))  # each common word ~ 1/3 of its share; a rare word at most twice
    lst = [w for w in common for _ in range(n_common)]
    lst += [rare[i % len(rare)] for i in range(min(total - len(lst), 2 * len(rare)))]
    rng.shuffle(lst)
    context = (
        "Below is a numbered list of words. Some of them appear more often than the others; memorize the "
        "ones that appear most often.\n" + " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst))
    )
    q = (
        f"What are the {top} most common words in the numbered list above? Answer: The {top} words that appear "
        "most often in the list are:"
    )
    return context, q, tuple(common)


def _qa(budget: int, rng: random.Random, tok, people: int = 6):
    names: list[str] = []
    while len(names) < people:
        n = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        if n not in names and all(n.split()[0] != m.split()[0] for m in names):
            names.append(n)
    cities = rng.sample(CITIES, people)
    facts = [f"{n} moved to {c} many years ago and still lives there." for n, c in zip(names, cities)]
    asked = rng.randrange(people)
    q = f"Question: In which town does {names[asked]} live? Answer: {names[asked]} lives in"
    return _fill(tok, facts, budget, rng), q, (cities[asked],)


def continuation(tok, tokens: int = 64, seed: int = 0) -> str:
    """About ``tokens`` tokens of the held-out sentences (never in a context), in an order drawn from ``seed``."""
    held = haystack()[-HELD_OUT:]
    random.Random(seed).shuffle(held)
    out: list[str] = []
    while _length(tok, " " + " ".join(out)) < tokens:
        out.append(held[len(out) % len(held)])
    return " " + " ".join(out)


def task(tok, kind: str, *, tokens: int = 1024, seed: int = 0, continuation_tokens: int = 64) -> Task:
    """One task of ``kind`` whose context and question come to about ``tokens`` tokens of ``tok`` (None: words),
    the same for the same seed."""
    if kind not in KINDS:
        raise ConfigError(f"task kind {kind!r}: use one of {', '.join(KINDS)}")
    checks.int_at_least("tokens", tokens, 128, what=" (the prompt's length in tokens)")
    rng = random.Random(f"{kind}:{tokens}:{seed}")
    budget = tokens - _length(tok, INTRO) - 50  # the question's share, about
    if kind.startswith("niah"):
        context, q, answers = _niah(kind, budget, rng, tok)
    elif kind == "variable_tracking":
        context, q, answers = _variables(budget, rng, tok)
    elif kind == "common_words":
        context, q, answers = _common_words(budget + _length(tok, INTRO), rng, tok)
    else:
        context, q, answers = _qa(budget, rng, tok)
    if kind != "common_words":
        context = INTRO + context
    return Task(
        kind, context, "\n\n" + q, answers, continuation(tok, continuation_tokens, seed), NEW_TOKENS[kind], seed
    )


def make_suite(
    tok, n: int, *, tokens: int = 1024, seed: int = 0, kinds=KINDS, continuation_tokens: int = 64
) -> list[Task]:
    """``n`` tasks, the ``kinds`` in turn (task ``i`` of kind ``kinds[i % len(kinds)]``, seed ``seed * 100_003 +
    i``), each about ``tokens`` tokens: the same list for the same arguments."""
    checks.positive_int("n", n, what=" (tasks)")
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise ConfigError(f"kinds {list(kinds)}: give some of {', '.join(KINDS)}")
    return [
        task(
            tok, kinds[i % len(kinds)], tokens=tokens, seed=seed * 100_003 + i, continuation_tokens=continuation_tokens
        )
        for i in range(n)
    ]
