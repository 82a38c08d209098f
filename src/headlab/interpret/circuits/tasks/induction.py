"""Induction over repeated random tokens (Olsson et al. 2022, "In-context Learning and Induction Heads")."""

from __future__ import annotations

import torch

import headlab.checks as checks
from headlab.errors import ConfigError, InputError, ModelError
from headlab.interpret.atlas.scores import embeddings
from headlab.interpret.atlas.tasks import repeated
from headlab.interpret.circuits.tasks.base import PairMetric, TaskPairs, check_n, check_seed, mean_logprob, model_device
from headlab.models.loaded_model import resolve


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
    check_n(n)
    check_seed(seed)
    adapter, loaded = resolve(model)
    tok = getattr(loaded, "tokenizer", None)
    if vocab is not None:
        checks.int_at_least("vocab", vocab, 2, what=" (ids are drawn from 0..vocab - 1)")
    try:
        rows = int(embeddings(adapter.model)[0].shape[0])
    except ModelError:
        rows = None
    if vocab is None:
        if rows is None:
            raise ConfigError(
                f"cannot find the token embedding of {type(adapter.model).__name__}: pass vocab= (ids "
                "are drawn from 0..vocab - 1)"
            )
        vocab = min(rows, len(tok)) if tok is not None else rows
    elif rows is not None and vocab > rows:
        raise InputError(
            f"vocab={vocab} but the model embeds {rows} tokens: ids from {rows} up would be out of range; "
            f"pass vocab <= {rows}"
        )
    ids, start = repeated(tok, vocab=vocab, n=n, half=half, seed=seed)  # (n, P + 2 half + S)
    banned = (
        set(getattr(tok, "all_special_ids", []) or [])
        | set(ids[:, :start].flatten().tolist())
        | set(ids[:, start + 2 * half :].flatten().tolist())
    )
    allowed = torch.ones(vocab, dtype=torch.bool)
    allowed[[t for t in banned if t < vocab]] = False
    g = torch.Generator().manual_seed(seed + 2**32)  # the corrupted halves: apart from repeated's own draw
    corrupt = ids.clone()
    for i in range(n):
        pool = allowed.clone()
        pool[ids[i, start : start + half]] = False
        pool = pool.nonzero().flatten()
        if len(pool) == 0:
            raise ConfigError(
                f"vocab={vocab} leaves no token outside the {half} of a clean half for the corrupted "
                "half; use a larger vocab or a smaller half"
            )
        corrupt[i, start : start + half] = pool[torch.randint(0, len(pool), (half,), generator=g)]
    positions = (start + half + torch.arange(half - 1)).expand(n, -1)  # (n, half - 1): x_1..x_{T-1}, second half
    targets = ids[:, start + half + 1 : start + 2 * half]  # (n, half - 1): x_2..x_T
    device = model_device(adapter)
    mask = torch.ones_like(ids)
    metric = PairMetric("induction_logprob", mean_logprob, {"targets": targets, "positions": positions.clone()})
    return TaskPairs(
        "induction",
        {"input_ids": ids.to(device), "attention_mask": mask.to(device)},
        {"input_ids": corrupt.to(device), "attention_mask": mask.clone().to(device)},
        metric,
        [0] * n,
        f"induction (Olsson et al. 2022): {half} random tokens repeated, corrupted by another random "
        "first half; metric mean log-prob of the right next token over the second half",
    )
