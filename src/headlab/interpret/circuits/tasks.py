"""Clean/corrupted prompt pairs with a metric, for circuit discovery: IOI, greater-than, induction, retrieval.

Every builder returns a :class:`TaskPairs`: ``B`` clean prompts, their corrupted twins (the same length
token by token and the same attention mask, so that patching replaces position ``i`` by position ``i``),
and a metric ``metric(logits (B, L, V)) -> (B,)`` as :func:`headlab.patch` takes it. Prompts are
right-padded; every metric reads each row at its last *real* token. A pair whose clean and corrupted
prompts tokenise to different lengths is dropped and another one drawn.

- ``ioi`` (Wang et al. 2022): "Then, Mary and John went to the store. John gave a drink to" -> " Mary";
  corrupted: the same template with three other, all-different names; metric logit(IO) - logit(S).
- ``greater-than`` (Hanna et al. 2023): "The war lasted from the year 1732 to the year 17"; corrupted:
  YY = "01"; metric p(year > YY) - p(year <= YY) (on a digit-by-digit tokenizer, over the tens digit:
  see :func:`greater_than`).
- ``induction`` (Olsson et al. 2022): random tokens x_1..x_T x_1..x_T; corrupted: y_1..y_T x_1..x_T;
  metric the mean log-probability of the right next token over the second half.
- ``retrieval`` (associative recall): "Emily Moscow. Michael Paris. Richard London. Michael" -> " Paris";
  corrupted: the query names another key of the context; metric logit(V) - logit(V').

    >>> import torch
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> m = Transformer(TransformerConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, causal=True)).eval()
    >>> pairs = induction(m, n=4, half=5, vocab=50)
    >>> pairs.clean["input_ids"].shape, pairs.metric.__name__, len(pairs.subset([0, 2]))
    (torch.Size([4, 10]), 'induction_logprob', 2)
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from headlab.errors import ConfigError, InputError, ModelError, ShapeError
from headlab.interpret.atlas.scores import embeddings
from headlab.interpret.atlas.tasks import repeated
from headlab.interpret.patching.metrics import Metric, check_ids, check_position, logit_diff
from headlab.interpret.patching.prompts import prompt_pair
from headlab.models.loaded_model import resolve

# ---------------------------------------------------------------------------------------------------------------
# IOI (Wang et al. 2022, "Interpretability in the Wild", arXiv 2211.00593)

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
NAMES = ["Mary", "John", "Anne", "Paul", "Sarah", "James", "Lisa", "Mark", "Tom", "Kate", "David", "Laura", "Michael",
         "Emma", "Daniel", "Rachel", "Peter", "Alice", "George", "Susan", "Robert", "Linda", "Steven", "Helen",
         "Richard", "Karen", "Thomas", "Emily", "Andrew", "Jessica"]
PLACES = ["store", "garden", "restaurant", "school", "hospital", "office", "house", "station"]
OBJECTS = ["ring", "kiss", "bone", "basketball", "computer", "necklace", "drink", "snack"]

# ---------------------------------------------------------------------------------------------------------------
# greater-than (Hanna, Liu and Variengien 2023, "How does GPT-2 compute greater-than?", arXiv 2305.00586)

GREATER_THAN = "The {noun} lasted from the year {century}{yy} to the year {century}"
CENTURY = "17"
# nouns of events that last a span of years, in the manner of Hanna et al.'s (their list is longer)
NOUNS = ["war", "siege", "reign", "rebellion", "occupation", "expedition", "famine", "drought", "plague", "truce",
         "alliance", "crusade", "voyage", "dynasty", "embargo", "revolt", "conflict", "dispute", "pilgrimage",
         "construction"]

# ---------------------------------------------------------------------------------------------------------------
# retrieval: associative recall in words (the key-value recall of Fu et al. 2023's H3 and Arora et al. 2023's
# Zoology, with names as keys and cities as values)

CITIES = ["Paris", "Rome", "Berlin", "Tokyo", "London", "Madrid", "Vienna", "Dublin", "Oslo", "Cairo", "Boston",
          "Chicago", "Sydney", "Moscow", "Athens", "Prague"]
# the paraphrases: what joins the "key value" facts, and the facts to the query key
SEPARATORS = [". ", ", ", " and "]
FACTS = 3  # key-value facts per prompt: 12 tokens on SmolLM2, so 64 pairs run quickly


@dataclass(frozen=True)
class TaskPairs:
    """``B`` clean/corrupted prompt pairs of one task and the metric that scores a run on them.

    Attributes:
        name: ``"ioi"``, ``"greater-than"``, ``"induction"`` or ``"retrieval"``.
        clean: ``{"input_ids": (B, L) long, "attention_mask": (B, L)}``, right-padded.
        corrupted: the same shape and the same attention mask as ``clean`` (position ``i`` is patched by
            position ``i``); every row differs from its clean twin.
        metric: ``metric(logits (B, L, V)) -> (B,)``, one value per pair, as :func:`headlab.patch` takes it;
            it has a ``__name__`` and a ``subset(idx)``.
        template: per pair, which template or paraphrase it came from (to see the spread across templates).
        description: one line: the task, its corruption, its metric, its paper.
    """

    name: str
    clean: dict
    corrupted: dict
    metric: Callable
    template: list[int]
    description: str

    def __len__(self) -> int:
        return int(self.clean["input_ids"].shape[0])

    def subset(self, idx) -> TaskPairs:
        """The pairs ``idx`` (a list of ints in ``0..B-1``, repeats allowed), with the metric of those pairs."""
        n = len(self)
        try:
            rows = [int(i) for i in idx] if not isinstance(idx, (str, bytes)) else None
        except (TypeError, ValueError):
            rows = None
        if not rows or any(isinstance(i, bool) for i in idx) or any(not 0 <= i < n for i in rows):
            raise ConfigError(f"subset takes a non-empty list of pair indices in 0..{n - 1}, got {idx!r}")
        sub = getattr(self.metric, "subset", None)
        if not callable(sub):
            raise ConfigError(f"the metric {getattr(self.metric, '__name__', self.metric)!r} has no subset(idx), so "
                              "it cannot be restricted to some pairs; build the pairs with a task builder "
                              "(headlab.interpret.circuits.tasks.task) or give the metric a subset method")
        take = torch.tensor(rows, dtype=torch.long)

        def part(d: dict) -> dict:
            return {k: v[take.to(v.device)] if isinstance(v, torch.Tensor) else v for k, v in d.items()}

        return TaskPairs(self.name, part(self.clean), part(self.corrupted), sub(rows),
                         [self.template[i] for i in rows], self.description)


class PairMetric:
    """``metric(logits (B, L, V)) -> (B,)`` over ``B`` pairs, kept as its per-pair ingredients.

    ``build(**per_pair, **shared)`` makes the metric; :meth:`subset` rebuilds it from the rows ``idx`` of
    every per-pair tensor, so that a subset of the pairs has the metric of those pairs.
    """

    def __init__(self, name: str, build: Callable[..., Metric], per_pair: dict[str, torch.Tensor], **shared):
        self.__name__ = name
        self.per_pair = per_pair
        self.shared = shared
        self._build = build
        self._fn = build(**per_pair, **shared)
        self.n = int(next(iter(per_pair.values())).shape[0])

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if isinstance(logits, torch.Tensor) and logits.dim() == 3:
            _logits(logits, self.n, self.__name__)
        return self._fn(logits)

    def subset(self, idx: Sequence[int]) -> PairMetric:
        i = torch.as_tensor(list(idx), dtype=torch.long)
        return PairMetric(self.__name__, self._build, {k: v[i] for k, v in self.per_pair.items()}, **self.shared)

    def __repr__(self) -> str:
        return f"PairMetric({self.__name__!r}, {self.n} pairs)"


# ---------------------------------------------------------------------------------------------------------------
# metrics beside headlab.interpret.patching.metrics.logit_diff


def _logits(logits: torch.Tensor, batch: int, name: str) -> tuple[int, int, int]:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ShapeError(f"{name} reads logits of shape (batch, seq, vocab); got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.shape[0] != batch:
        raise ShapeError(f"{name} was built for {batch} pairs but got logits for {logits.shape[0]}; use "
                         "TaskPairs.subset(idx) for a subset of the pairs")
    return tuple(logits.shape)


def signed_prob(ids: torch.Tensor, sign: torch.Tensor, position: torch.Tensor) -> Metric:
    """``metric(logits)[b] = sum_k sign[b, k] * softmax(logits[b, position[b]])[ids[k]]``, shape ``(B,)``.

    Args:
        ids: ``(K,)`` the answer tokens (years, digits).
        sign: ``(B, K)`` +1 for a token that counts for the answer, -1 against, 0 neither.
        position: ``(B,)`` where each row predicts (its last real token).

    Hanna et al.'s probability difference is ``sign = +1 for y > YY, -1 for y <= YY``.
    """
    B = sign.shape[0]

    def metric(logits: torch.Tensor) -> torch.Tensor:
        _, L, V = _logits(logits, B, "prob_diff")
        check_ids(ids, "answer token", V)
        pos = check_position(position, L, B).to(logits.device)
        rows = logits[torch.arange(B, device=logits.device), pos]  # (B, V)
        p = rows.to(torch.promote_types(rows.dtype, torch.float32)).softmax(-1)  # half precision read in float32
        return (p[:, ids.to(logits.device)] * sign.to(logits.device)).sum(-1)

    metric.__name__ = "prob_diff"
    return metric


def mean_logprob(targets: torch.Tensor, positions: torch.Tensor) -> Metric:
    """``metric(logits)[b] = mean_t log softmax(logits[b, positions[b, t]])[targets[b, t]]``, shape ``(B,)``.

    Args:
        targets: ``(B, T)`` the right next token at each scored position.
        positions: ``(B, T)`` the positions that predict them.
    """
    B = targets.shape[0]

    def metric(logits: torch.Tensor) -> torch.Tensor:
        _, L, V = _logits(logits, B, "induction_logprob")
        check_ids(targets.reshape(-1), "target token", V)
        check_position(positions.reshape(-1), L, positions.numel(), "scored position")
        dev = logits.device
        rows = logits[torch.arange(B, device=dev)[:, None], positions.to(dev)]  # (B, T, V)
        rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
        right = rows.gather(-1, targets.to(dev)[..., None]).squeeze(-1)  # (B, T)
        return (right - rows.logsumexp(-1)).mean(-1)

    metric.__name__ = "induction_logprob"
    return metric


def _logit_diff(correct: torch.Tensor, wrong: torch.Tensor, position: torch.Tensor) -> Metric:
    return logit_diff(correct, wrong, position=position)


# ---------------------------------------------------------------------------------------------------------------
# checks shared by the builders


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"n (the number of clean/corrupted pairs) must be a positive int, got {n!r}; pass e.g. n=64")
    return n


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an int, got {seed!r}")
    return seed


def _tokenizer(model, task: str):
    """The model's tokenizer, checked to add nothing after a text (the metric reads the next-token
    prediction at the last real token)."""
    tok = getattr(model, "tokenizer", None)
    if tok is None or not callable(getattr(model, "encode", None)):
        raise ModelError(f"the {task} task builds text prompts: pass a model loaded with its tokenizer "
                         f"(headlab.load(...)), not {type(model).__name__}")
    bare = list(tok("a", add_special_tokens=False)["input_ids"])
    full = list(tok("a")["input_ids"])
    if full[len(full) - len(bare):] != bare:
        after = tok.convert_ids_to_tokens(full[len(full) - 1:])
        raise InputError(f"the tokenizer puts {after} after every text, so the last token is not where the next "
                         f"word is predicted; the {task} task needs a causal language model's tokenizer")
    return tok


def _single(tok, word: str) -> bool:
    """Whether ``word`` after a space (as the templates place it) is one token, and not the unknown one."""
    ids = tok(" " + word, add_special_tokens=False)["input_ids"]
    return len(ids) == 1 and ids[0] != getattr(tok, "unk_token_id", None)


def _device(model) -> torch.device:
    adapter, _ = resolve(model)
    p = next(iter(adapter.model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _draws(n: int) -> int:
    """How many candidate pairs a builder may draw for ``n`` kept ones before it gives up."""
    return 20 * n + 100


def _too_few(task: str, kept: int, n: int, tried: int, why: str) -> InputError:
    return InputError(f"{task}: only {kept} of {n} pairs kept after {tried} draws ({why}); this tokenizer splits the "
                      "task's words unevenly: use a model whose tokenizer keeps them whole, or ask for fewer pairs")


# ---------------------------------------------------------------------------------------------------------------
# IOI


def _ioi_templates(templates) -> list[str]:
    """The BABA templates to use: None (all of Wang et al.'s), or a list of indices into :data:`BABA` and/or
    templates of one's own in BABA form (``[B] and [A]`` once, ``[B]`` again later)."""
    if templates is None:
        return list(BABA)
    if isinstance(templates, (str, int)) or not isinstance(templates, Sequence) or not templates:
        raise ConfigError(f"templates must be a non-empty list of indices into BABA (0..{len(BABA) - 1}) or BABA-form "
                          f"strings, got {templates!r}")
    out = []
    for t in templates:
        if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(BABA):
            out.append(BABA[t])
        elif isinstance(t, str) and "[B] and [A]" in t and t.count("[A]") == 1 and t.count("[B]") == 2:
            out.append(t)
        else:
            raise ConfigError(f"IOI template {t!r} is neither an index into BABA (0..{len(BABA) - 1}) nor a BABA-form "
                              "string: write '[B] and [A]' once and '[B]' once more later, e.g. "
                              f"{BABA[0]!r}")
    return out


def _ioi_stream(tokenizer, seed: int, templates=None) -> Iterator[tuple[str, str, str, str, int]]:
    """Endless ``(clean, corrupted, io, s, template id)``: BABA and ABBA alternating, templates in turn.

    The names, places and objects are the ones ``tokenizer`` keeps as one token after a space. The
    corrupted prompt is Wang et al.'s ABC: the same template with three other names, all different.
    Template ids: BABA template ``k`` is ``k``, its ABBA twin ``len(templates) + k``.
    """
    baba = _ioi_templates(templates)
    abba = [t.replace("[B] and [A]", "[A] and [B]", 1) for t in baba]
    names = [w for w in NAMES if _single(tokenizer, w)]
    places = [w for w in PLACES if _single(tokenizer, w)]
    objects = [w for w in OBJECTS if _single(tokenizer, w)]
    uses = " ".join(baba)
    for what, have, pool, need in (("names", names, NAMES, 5), ("places", places, PLACES, int("[PLACE]" in uses)),
                                   ("objects", objects, OBJECTS, int("[OBJECT]" in uses))):
        if len(have) < need:
            missing = [w for w in pool if w not in have]
            raise InputError(f"IOI needs at least {need} {what} that the tokenizer keeps as one token after a space; "
                             f"it keeps {len(have)} ({have}) and splits or lacks {missing[:8]}: use a model whose "
                             "vocabulary has them")
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
    _check_n(n)
    stream = _ioi_stream(tokenizer, _check_seed(seed), templates)
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
    _check_n(n)
    tok = _tokenizer(model, "ioi")
    stream = _ioi_stream(tok, _check_seed(seed), templates)
    kept, tried = [], 0
    while len(kept) < n:
        if tried >= _draws(n):
            raise _too_few("ioi", len(kept), n, tried, "clean and corrupted prompts of different lengths")
        clean, corrupt, io, s, k = next(stream)
        tried += 1
        if len(tok(clean)["input_ids"]) == len(tok(corrupt)["input_ids"]):
            kept.append((clean, corrupt, io, s, k))
    clean, corrupt, io, s, k = (list(x) for x in zip(*kept))
    a, b, _ = prompt_pair(model, clean, corrupt, [" " + w for w in io], [" " + w for w in s])
    io_ids = torch.tensor([tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in io])
    s_ids = torch.tensor([tok(" " + w, add_special_tokens=False)["input_ids"][0] for w in s])
    last = a["attention_mask"].sum(-1).cpu() - 1  # (B,) the last real token of each right-padded prompt
    metric = PairMetric("logit_diff", _logit_diff, {"correct": io_ids, "wrong": s_ids, "position": last})
    return TaskPairs("ioi", a, b, metric, k,
                     "IOI (Wang et al. 2022): BABA/ABBA templates, corrupted by ABC (three other all-different names); "
                     "metric logit(IO) - logit(S) at the last token")


# ---------------------------------------------------------------------------------------------------------------
# greater-than


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
        pieces = tok.convert_ids_to_tokens(full[max(0, len(base) - 2):])
        if full[:len(base)] != base:
            raise InputError(f"greater-than: the tokenizer merges the century {CENTURY!r} with the digits after it "
                             f"({CENTURY + c!r} ends as {pieces}), so the prompt cannot end at the century; it needs "
                             "year digits that tokenise apart from the century, one token per two digits (GPT-2) or "
                             "per digit (Llama, SmolLM2)")
        if unk is not None and unk in full[len(base):]:
            lack = [ch for ch in dict.fromkeys(c) if tok(ch, add_special_tokens=False)["input_ids"] in ([unk], [])]
            raise InputError(f"greater-than: the tokenizer has no token {lack[0] if lack else c!r}: the year digits "
                             f"{c!r} after {CENTURY!r} read as {pieces}, with the unknown token; it needs each of "
                             "'00'..'99' or each of '0'..'9' as a token")
        rest[c] = full[len(base):]
    if all(len(r) == 1 for r in rest.values()) and len({r[0] for r in rest.values()}) == 100:
        return "pair", [rest[f"{y:02d}"][0] for y in range(100)]
    tens = {}
    for c, r in rest.items():
        tens.setdefault(c[0], set()).add(r[0] if len(r) == 2 else None)
    if all(len(r) == 2 for r in rest.values()) and all(len(v) == 1 for v in tens.values()) \
            and len({next(iter(v)) for v in tens.values()}) == 10:
        return "digit", [next(iter(tens[str(d)])) for d in range(10)]
    odd = next((c for c, r in rest.items() if len(r) != len(rest["00"])), "32")
    raise InputError(f"greater-than: after {prompt!r} the year's last two digits {odd!r} tokenise as "
                     f"{tok.convert_ids_to_tokens(rest[odd])} and '00' as {tok.convert_ids_to_tokens(rest['00'])}; "
                     "the probability difference needs every two-digit year as one token (GPT-2's '32') or every digit "
                     "as one (SmolLM2's '3' '2')")


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
    _check_n(n)
    tok = _tokenizer(model, "greater-than")
    mode, ids = _year_tokens(tok, GREATER_THAN.format(noun=NOUNS[0], century=CENTURY, yy="32"))
    low, high = (2, 98) if mode == "pair" else (10, 89)
    rng = random.Random(_check_seed(seed))
    kept, tried = [], 0
    while len(kept) < n:
        if tried >= _draws(n):
            raise _too_few("greater-than", len(kept), n, tried, "years that tokenise to different lengths")
        k, yy = rng.randrange(len(NOUNS)), rng.randint(low, high)
        tried += 1
        clean = GREATER_THAN.format(noun=NOUNS[k], century=CENTURY, yy=f"{yy:02d}")
        corrupt = GREATER_THAN.format(noun=NOUNS[k], century=CENTURY, yy="01")
        if len(tok(clean)["input_ids"]) == len(tok(corrupt)["input_ids"]):
            kept.append((clean, corrupt, k, yy))
    clean, corrupt, k, yy = (list(x) for x in zip(*kept))
    a, b = model.encode(clean), model.encode(corrupt)
    last = a["attention_mask"].sum(-1).cpu() - 1  # (B,) the last real token: the century's last token
    years = torch.tensor(yy)[:, None]  # (B, 1)
    if mode == "pair":
        sign = torch.where(torch.arange(100)[None, :] > years, 1.0, -1.0)  # (B, 100): +1 for y > YY
        how = "p(year > YY) - p(year <= YY) over the two-digit year tokens"
    else:
        sign = torch.sign(torch.arange(10)[None, :] - years // 10).float()  # (B, 10): tens digit vs YY's
        how = ("p(tens digit > YY's) - p(tens digit < YY's) over the next digit (digits are single tokens; YY's own "
               "decade counts neither way)")
    metric = PairMetric("prob_diff", signed_prob, {"sign": sign, "position": last}, ids=torch.tensor(ids))
    return TaskPairs("greater-than", a, b, metric, k,
                     f"greater-than (Hanna et al. 2023): 'The war lasted from the year 17YY to the year 17', "
                     f"corrupted YY=01; metric {how}")


# ---------------------------------------------------------------------------------------------------------------
# induction


def induction(model, n: int = 64, *, half: int = 16, seed: int = 0, vocab: int | None = None) -> TaskPairs:
    """Induction over repeated random tokens (Olsson et al. 2022): ``x_1..x_T x_1..x_T``, ``T = half``.

    Clean: :func:`headlab.interpret.atlas.tasks.repeated` (the atlas's sequences, the model's special tokens
    around them, no special token drawn). Corrupted: the same second half after another random first half
    ``y_1..y_T`` that shares no token with the row's ``x``, so an induction head finds nothing to copy. Metric:
    the mean over the second half of the log-probability of the right next token: positions ``T + j``
    (reading ``x_j``) predicting ``x_{j+1}``, ``j = 1..T-1`` (``x_1`` in the second half cannot be predicted).

        clean      x1 x2 x3 x4 | x1 x2 x3 x4      scored: x2 x3 x4 after x1 x2 x3 of the second half
        corrupted  y1 y2 y3 y4 | x1 x2 x3 x4

    Args:
        model: a :func:`headlab.load` model, or a bare model or adapter (token ids; give ``vocab``).
        n: pairs (a positive int). half: tokens per half (at least 2). seed: the draw.
        vocab: ids are drawn from ``0..vocab - 1``; default the model's embedding rows (and at most the
            tokenizer's size, so no untrained padding row of the embedding is drawn).

    Raises:
        ConfigError: a bad ``n``, ``half``, ``seed`` or ``vocab``; InputError: ``vocab`` beyond the embedding.
    """
    _check_n(n)
    _check_seed(seed)
    adapter, loaded = resolve(model)
    tok = getattr(loaded, "tokenizer", None)
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2):
        raise ConfigError(f"vocab must be an int of at least 2 (ids are drawn from 0..vocab - 1), got {vocab!r}")
    try:
        rows = int(embeddings(adapter.model)[0].shape[0])
    except ModelError:
        rows = None
    if vocab is None:
        if rows is None:
            raise ConfigError(f"cannot find the token embedding of {type(adapter.model).__name__}: pass vocab= (ids "
                              "are drawn from 0..vocab - 1)")
        vocab = min(rows, len(tok)) if tok is not None else rows
    elif rows is not None and vocab > rows:
        raise InputError(f"vocab={vocab} but the model embeds {rows} tokens: ids from {rows} up would be out of range; "
                         f"pass vocab <= {rows}")
    ids, start = repeated(tok, vocab=vocab, n=n, half=half, seed=seed)  # (n, P + 2 half + S)
    banned = set(getattr(tok, "all_special_ids", []) or []) | set(ids[:, :start].flatten().tolist()) \
        | set(ids[:, start + 2 * half:].flatten().tolist())
    allowed = torch.ones(vocab, dtype=torch.bool)
    allowed[[t for t in banned if t < vocab]] = False
    g = torch.Generator().manual_seed(seed + 2 ** 32)  # the corrupted halves: apart from repeated's own draw
    corrupt = ids.clone()
    for i in range(n):
        pool = allowed.clone()
        pool[ids[i, start:start + half]] = False
        pool = pool.nonzero().flatten()
        if len(pool) == 0:
            raise ConfigError(f"vocab={vocab} leaves no token outside the {half} of a clean half for the corrupted "
                              "half; use a larger vocab or a smaller half")
        corrupt[i, start:start + half] = pool[torch.randint(0, len(pool), (half,), generator=g)]
    positions = (start + half + torch.arange(half - 1)).expand(n, -1)  # (n, half - 1): x_1..x_{T-1}, second half
    targets = ids[:, start + half + 1:start + 2 * half]  # (n, half - 1): x_2..x_T
    device = _device(adapter)
    mask = torch.ones_like(ids)
    metric = PairMetric("induction_logprob", mean_logprob, {"targets": targets, "positions": positions.clone()})
    return TaskPairs("induction", {"input_ids": ids.to(device), "attention_mask": mask.to(device)},
                     {"input_ids": corrupt.to(device), "attention_mask": mask.clone().to(device)}, metric, [0] * n,
                     f"induction (Olsson et al. 2022): {half} random tokens repeated, corrupted by another random "
                     "first half; metric mean log-prob of the right next token over the second half")


# ---------------------------------------------------------------------------------------------------------------
# retrieval


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
    _check_n(n)
    tok = _tokenizer(model, "retrieval")
    keys_ok = [w for w in NAMES if _single(tok, w)]
    values_ok = [w for w in CITIES if _single(tok, w)]
    for what, have, pool in (("names", keys_ok, NAMES), ("cities", values_ok, CITIES)):
        if len(have) < FACTS:
            raise InputError(f"retrieval needs {FACTS} {what} that the tokenizer keeps as one token after a space; it "
                             f"keeps {have} and splits or lacks {[w for w in pool if w not in have][:8]}: use a model "
                             "whose vocabulary has them")
    rng = random.Random(_check_seed(seed))
    kept, tried = [], 0
    while len(kept) < n:
        if tried >= _draws(n):
            raise _too_few("retrieval", len(kept), n, tried, "clean and corrupted prompts of different lengths")
        k = len(kept) % len(SEPARATORS)
        sep = SEPARATORS[k]
        keys, values = rng.sample(keys_ok, FACTS), rng.sample(values_ok, FACTS)
        q, q2 = rng.sample(range(FACTS), 2)
        tried += 1
        context = sep.join(f"{key} {v}" for key, v in zip(keys, values)) + sep
        clean, corrupt = context + keys[q], context + keys[q2]
        if len(tok(clean)["input_ids"]) == len(tok(corrupt)["input_ids"]):
            kept.append((clean, corrupt, " " + values[q], " " + values[q2], k))
    clean, corrupt, right, wrong, k = (list(x) for x in zip(*kept))
    a, b, _ = prompt_pair(model, clean, corrupt, right, wrong)
    last = a["attention_mask"].sum(-1).cpu() - 1
    metric = PairMetric("logit_diff", _logit_diff, {
        "correct": torch.tensor([tok(w, add_special_tokens=False)["input_ids"][0] for w in right]),
        "wrong": torch.tensor([tok(w, add_special_tokens=False)["input_ids"][0] for w in wrong]), "position": last})
    return TaskPairs("retrieval", a, b, metric, k,
                     f"associative recall (Fu et al. 2023, Arora et al. 2023) in words: {FACTS} 'name city' facts then "
                     "one name again, corrupted by querying another name of the context; metric logit(V) - logit(V') "
                     "at the last token")


# ---------------------------------------------------------------------------------------------------------------

TASKS: dict[str, Callable[..., TaskPairs]] = {
    "ioi": ioi,
    "greater-than": greater_than,
    "induction": induction,
    "retrieval": retrieval,
}


def task(name: str, model, n: int = 64, *, seed: int = 0, **kw) -> TaskPairs:
    """The pairs of the task ``name`` (a key of :data:`TASKS`); ``kw`` goes to its builder (``half=``,
    ``vocab=`` for induction, ``templates=`` for IOI).

        >>> task("copying", None)
        Traceback (most recent call last):
        ...
        headlab.errors.ConfigError: unknown task 'copying'; the tasks are: ioi, greater-than, induction, retrieval
    """
    build = TASKS.get(name) if isinstance(name, str) else None
    if build is None:
        raise ConfigError(f"unknown task {name!r}; the tasks are: {', '.join(TASKS)}")
    takes = [p for p in inspect.signature(build).parameters if p not in ("model", "n", "seed")]
    bad = [k for k in kw if k not in takes]
    if bad:
        raise ConfigError(f"the {name} task takes no option {bad[0]!r}; its options are: {', '.join(takes) or 'none'}")
    return build(model, n, seed=seed, **kw)


__all__ = ["ABBA", "BABA", "CENTURY", "CITIES", "GREATER_THAN", "NAMES", "NOUNS", "OBJECTS", "PLACES", "SEPARATORS",
           "TASKS", "PairMetric", "TaskPairs", "greater_than", "induction", "ioi", "ioi_prompts", "mean_logprob",
           "retrieval", "signed_prob", "task"]
