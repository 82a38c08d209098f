"""What every task shares: :class:`TaskPairs`, :class:`PairMetric`, the metrics beside
:func:`headlab.interpret.patching.metrics.logit_diff`, and the checks and helpers the builders use."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import headlab.checks as checks
from headlab.errors import ConfigError, InputError, ModelError, ShapeError
from headlab.interpret.patching.metrics import Metric, check_ids, check_position, logit_diff
from headlab.models.loaded_model import resolve


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
            raise ConfigError(
                f"the metric {getattr(self.metric, '__name__', self.metric)!r} has no subset(idx), so "
                "it cannot be restricted to some pairs; build the pairs with a task builder "
                "(headlab.interpret.circuits.tasks.task) or give the metric a subset method"
            )
        take = torch.tensor(rows, dtype=torch.long)

        def part(d: dict) -> dict:
            return {k: v[take.to(v.device)] if isinstance(v, torch.Tensor) else v for k, v in d.items()}

        return TaskPairs(
            self.name,
            part(self.clean),
            part(self.corrupted),
            sub(rows),
            [self.template[i] for i in rows],
            self.description,
        )


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
            check_logits(logits, self.n, self.__name__)
        return self._fn(logits)

    def subset(self, idx: Sequence[int]) -> PairMetric:
        i = torch.as_tensor(list(idx), dtype=torch.long)
        return PairMetric(self.__name__, self._build, {k: v[i] for k, v in self.per_pair.items()}, **self.shared)

    def __repr__(self) -> str:
        return f"PairMetric({self.__name__!r}, {self.n} pairs)"


# ---------------------------------------------------------------------------------------------------------------
# metrics beside headlab.interpret.patching.metrics.logit_diff


def check_logits(logits: torch.Tensor, batch: int, name: str) -> tuple[int, int, int]:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ShapeError(
            f"{name} reads logits of shape (batch, seq, vocab); got "
            f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}"
        )
    if logits.shape[0] != batch:
        raise ShapeError(
            f"{name} was built for {batch} pairs but got logits for {logits.shape[0]}; use "
            "TaskPairs.subset(idx) for a subset of the pairs"
        )
    B, L, V = logits.shape
    return B, L, V


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
        _, L, V = check_logits(logits, B, "prob_diff")
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
        _, L, V = check_logits(logits, B, "induction_logprob")
        check_ids(targets.reshape(-1), "target token", V)
        check_position(positions.reshape(-1), L, positions.numel(), "scored position")
        dev = logits.device
        rows = logits[torch.arange(B, device=dev)[:, None], positions.to(dev)]  # (B, T, V)
        rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
        right = rows.gather(-1, targets.to(dev)[..., None]).squeeze(-1)  # (B, T)
        return (right - rows.logsumexp(-1)).mean(-1)

    metric.__name__ = "induction_logprob"
    return metric


def pair_logit_diff(correct: torch.Tensor, wrong: torch.Tensor, position: torch.Tensor) -> Metric:
    return logit_diff(correct, wrong, position=position)


# ---------------------------------------------------------------------------------------------------------------
# checks shared by the builders


MAX_PAIRS = 10_000  # every pair is a row of every forward: more would not fit a study on one machine


def check_n(n) -> int:
    checks.positive_int("n", n, what=" (the number of clean/corrupted pairs)", hint="; pass e.g. n=64")
    if n > MAX_PAIRS:
        raise ConfigError(
            f"n={n:,} pairs: a task builds at most {MAX_PAIRS:,} (each pair is a row of every forward); pass e.g. n=64"
        )
    return n


def check_seed(seed) -> int:
    return checks.integer("seed", seed)


def text_tokenizer(model, task: str):
    """The model's tokenizer, checked to add nothing after a text (the metric reads the next-token
    prediction at the last real token)."""
    tok = getattr(model, "tokenizer", None)
    if tok is None or not callable(getattr(model, "encode", None)):
        raise ModelError(
            f"the {task} task builds text prompts: pass a model loaded with its tokenizer "
            f"(headlab.load(...)), not {type(model).__name__}"
        )
    bare = list(tok("a", add_special_tokens=False)["input_ids"])
    full = list(tok("a")["input_ids"])
    if full[len(full) - len(bare) :] != bare:
        after = tok.convert_ids_to_tokens(full[len(full) - 1 :])
        raise InputError(
            f"the tokenizer puts {after} after every text, so the last token is not where the next "
            f"word is predicted; the {task} task needs a causal language model's tokenizer"
        )
    return tok


def single_token(tok, word: str) -> bool:
    """Whether ``word`` after a space (as the templates place it) is one token, and not the unknown one."""
    ids = tok(" " + word, add_special_tokens=False)["input_ids"]
    return len(ids) == 1 and ids[0] != getattr(tok, "unk_token_id", None)


def model_device(model) -> torch.device:
    adapter, _ = resolve(model)
    p = next(iter(adapter.model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def max_draws(n: int) -> int:
    """How many candidate pairs a builder may draw for ``n`` kept ones before it gives up."""
    return 20 * n + 100


def too_few(task: str, kept: int, n: int, tried: int, why: str) -> InputError:
    return InputError(
        f"{task}: only {kept} of {n} pairs kept after {tried} draws ({why}); this tokenizer splits the "
        "task's words unevenly: use a model whose tokenizer keeps them whole, or ask for fewer pairs"
    )
