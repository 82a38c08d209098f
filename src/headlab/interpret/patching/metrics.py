"""Metrics for patching: functions of the logits, one value per example.

A metric is any callable ``metric(logits) -> (B,)`` (or a 0-dim tensor, read as the mean) where
``logits`` is the model's ``(B, L, V)`` output for a batch of ``B`` examples. Patching evaluates it on
the clean run, on the corrupted run and on every patched run, and compares the means over examples.

:func:`logit_diff` is the metric of Wang et al. (2022): the logit of the right answer minus the logit
of the wrong one, at the last token of each prompt:

    >>> import torch
    >>> logits = torch.zeros(2, 3, 5); logits[0, -1, 1] = 2.0; logits[1, 1, 4] = -1.0
    >>> m = logit_diff([1, 4], [0, 0], position=[2, 1])
    >>> m(logits)
    tensor([ 2., -1.])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from headlab.errors import ConfigError, InputError, ShapeError

Metric = Callable[[torch.Tensor], torch.Tensor]


def ids_of(x, name: str, vocab: int | None = None) -> torch.Tensor:
    """``x`` as a 1-d tensor of token ids; ConfigError for anything else (floats, booleans, nesting), InputError
    for an id outside ``0..vocab - 1`` (a negative id would index from the end of the vocabulary)."""
    try:
        t = torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is None or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.dim() > 1 or t.numel() == 0:
        raise ConfigError(f"{name} must be a token id or a list of token ids (one per example), got {x!r}")
    t = t.long().reshape(-1)
    check_ids(t, name, vocab)
    return t


def check_ids(t: torch.Tensor, name: str, vocab: int | None = None) -> None:
    """Every id in ``0..vocab - 1`` (``vocab`` None: only non-negative), or an InputError saying which."""
    low, high = int(t.min()), int(t.max())
    if low < 0 or (vocab is not None and high >= vocab):
        bad = low if low < 0 else high
        span = f"0..{vocab - 1} (the vocabulary)" if vocab is not None else "0 or more"
        raise InputError(
            f"{name} {bad} is not a token id: ids lie in {span}; a negative id does not count from the end here"
        )


def check_position(position, length: int, batch: int, name: str = "position") -> torch.Tensor:
    """``position`` (an int, or one per example) as ``(batch,)`` indices into ``length`` positions; negatives
    count from the end (-1 the last). ShapeError for a wrong count, InputError for an index out of range
    (never wrapped round to another position)."""
    try:
        pos = torch.as_tensor(position)
    except (TypeError, ValueError, RuntimeError):
        pos = None
    if pos is None or pos.is_floating_point() or pos.dtype == torch.bool or pos.dim() > 1:
        raise ConfigError(f"{name} must be an int or one int per example, got {position!r}")
    pos = pos.long().reshape(-1).cpu()
    if pos.numel() not in (1, batch):
        raise ShapeError(f"{name} has {pos.numel()} entries for a batch of {batch}; give one int or one per example")
    bad = pos[(pos < -length) | (pos >= length)]
    if bad.numel():
        raise InputError(
            f"{name} {int(bad[0])} is out of range for {length} positions (0..{length - 1}, or "
            f"-{length}..-1 from the end)"
        )
    return pos.expand(batch) % length


def logit_rows(logits: torch.Tensor, position) -> torch.Tensor:
    """``(B, V)``: each example's logits at its ``position`` (an int, or one index per example)."""
    if logits.dim() != 3:
        raise ShapeError(f"a metric reads logits of shape (batch, seq, vocab); got {tuple(logits.shape)}")
    B, L, _ = logits.shape
    pos = check_position(position, L, B).to(logits.device)
    return logits[torch.arange(B, device=logits.device), pos]


def logit_diff(
    correct: int | Sequence[int] | torch.Tensor,
    wrong: int | Sequence[int] | torch.Tensor,
    *,
    position: int | Sequence[int] | torch.Tensor = -1,
) -> Metric:
    """``metric(logits) = logits[b, pos_b, correct_b] - logits[b, pos_b, wrong_b]``, shape ``(B,)``.

    Args:
        correct, wrong: one token id for every example, or one id per example (``(B,)``).
        position: where the answer is predicted: an int (default -1, the last token) or one index per
            example (the last real token of each right-padded prompt).
    """
    c, w = ids_of(correct, "correct"), ids_of(wrong, "wrong")
    n = max(c.numel(), w.numel())
    if c.numel() in (1, n) and w.numel() in (1, n):
        same = (c.expand(n) == w.expand(n)).nonzero().flatten()
        if same.numel():
            raise InputError(
                f"correct and wrong are the same token ({int(c.expand(n)[same[0]])}) for example "
                f"{int(same[0])}: their logit difference is 0 on every run, so it measures nothing"
            )

    def metric(logits: torch.Tensor) -> torch.Tensor:
        rows = logit_rows(logits, position)  # (B, V)
        B, V = rows.shape
        for name, t in (("correct", c), ("wrong", w)):
            if t.numel() not in (1, B):
                raise ShapeError(f"{name} has {t.numel()} ids for a batch of {B}; give one id or one per example")
            check_ids(t, name, V)
        ar = torch.arange(B, device=rows.device)
        return rows[ar, c.to(rows.device).expand(B)] - rows[ar, w.to(rows.device).expand(B)]

    metric.__name__ = "logit_diff"
    return metric


def logit_of(token: int | Sequence[int] | torch.Tensor, *, position=-1) -> Metric:
    """``metric(logits) = logits[b, pos_b, token_b]``: one logit, shape ``(B,)``."""
    t = ids_of(token, "token")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        rows = logit_rows(logits, position)
        B = rows.shape[0]
        if t.numel() not in (1, B):
            raise ShapeError(f"token has {t.numel()} ids for a batch of {B}; give one id or one per example")
        check_ids(t, "token", rows.shape[1])
        return rows[torch.arange(B, device=rows.device), t.to(rows.device).expand(B)]

    metric.__name__ = "logit"
    return metric


def logits_of(outputs) -> torch.Tensor:
    """The ``(B, L, V)`` logits of a model's outputs (``.logits``, or the tensor itself)."""
    got = outputs if isinstance(outputs, torch.Tensor) else getattr(outputs, "logits", None)
    if not isinstance(got, torch.Tensor):
        raise InputError(
            f"patching needs a model that returns logits (a language-model or classification head); "
            f"{type(outputs).__name__} has no .logits"
        )
    return got


def evaluate(metric: Metric, logits: torch.Tensor, n_examples: int) -> torch.Tensor:
    """``(C, B)`` metric values of ``C`` stacked runs of ``B`` examples (``logits (C * B, L, V)``)."""
    C = logits.shape[0] // n_examples
    out = []
    for c in range(C):
        v = metric(logits[c * n_examples : (c + 1) * n_examples])
        if not isinstance(v, torch.Tensor) or v.numel() not in (1, n_examples):
            raise ConfigError(
                f"metric(logits) must return a tensor of shape ({n_examples},) or a 0-dim tensor; "
                f"got {type(v).__name__}{tuple(v.shape) if isinstance(v, torch.Tensor) else ''}"
            )
        out.append(v.reshape(-1).expand(n_examples) if v.numel() == 1 else v.reshape(-1))
    return torch.stack(out)


__all__ = ["Metric", "check_ids", "check_position", "evaluate", "logit_diff", "logit_of", "logits_of"]
