"""Heads named on the command line (``--heads LAYER.HEAD,...``), read and checked against a model's shape, or
against its config files before the load (no weights read), for every command that names heads (``analyze``,
``heads prune``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from headlab.errors import InputError, ShapeError


def per_layer_counts(n_layers: int, n_heads: int | Sequence[int]) -> list[int]:
    """Heads of every layer from one count or a count per layer (checked against ``n_layers``).

    >>> per_layer_counts(2, 4), per_layer_counts(2, [3, 4])
    ([4, 4], [3, 4])
    """
    if isinstance(n_heads, int):
        return [n_heads] * n_layers
    counts = [int(c) for c in n_heads]
    if len(counts) != n_layers:
        raise ShapeError(f"{len(counts)} head counts for {n_layers} layers; pass one per layer.")
    return counts


def parse_heads(
    spec: str | Sequence[tuple[int, int]] | None, n_layers: int, n_heads: int | Sequence[int]
) -> list[tuple[int, int]] | None:
    """``"0.3,2.5"`` -> ``[(0, 3), (2, 5)]``, checked against the model's shape (``n_heads``: one
    count, or a count per layer for a pruned model).

    >>> parse_heads("0.3, 2.5", 6, 12)
    [(0, 3), (2, 5)]
    >>> parse_heads("6.0", 6, 12)
    Traceback (most recent call last):
    ...
    headlab.errors.InputError: head 6.0 does not exist: the model has layers 0..5 and heads 0..11
    """
    if spec is None:
        return None
    items: list[tuple[int, int]] = []
    if isinstance(spec, str):
        for part in filter(None, (p.strip() for p in spec.split(","))):
            try:
                layer, head = (int(x) for x in part.split("."))
            except ValueError:
                raise InputError(f"cannot read head {part!r}: write LAYER.HEAD, e.g. --heads 0.3,2.5") from None
            items.append((layer, head))
    else:
        items = [(int(a), int(b)) for a, b in spec]
    if not items:
        raise InputError("no heads given: write LAYER.HEAD pairs, e.g. --heads 0.3,2.5")
    for layer, head in items:
        check_head(layer, head, n_layers, n_heads)
    return list(dict.fromkeys(items))


def check_head(layer: int, head: int, n_layers: int, n_heads: int | Sequence[int]) -> None:
    """:class:`~headlab.errors.InputError` unless head ``layer.head`` exists (``n_heads``: one
    count or one per layer)."""
    counts = per_layer_counts(n_layers, n_heads)
    if not 0 <= layer < n_layers:
        which = f" and heads 0..{counts[0] - 1}" if len(set(counts)) == 1 else ""
        raise InputError(f"head {layer}.{head} does not exist: the model has layers 0..{n_layers - 1}{which}")
    if not 0 <= head < counts[layer]:
        which = (
            f"heads 0..{counts[layer] - 1}"
            if len(set(counts)) == 1
            else f"heads 0..{counts[layer] - 1} in layer {layer} (a pruned model: heads per layer {counts})"
        )
        raise InputError(f"head {layer}.{head} does not exist: the model has layers 0..{n_layers - 1} and {which}")


def check_heads_in_config(model, heads: str | None, option: str = "--heads") -> None:
    """``heads`` (``"LAYER.HEAD,..."``) against the model's config files (no weights read), so a head the model
    lacks stops the job before the load; a model whose config does not tell is checked after it (:func:`plan`)."""
    if heads is None or not isinstance(model, str | os.PathLike):
        return
    from headlab.models.loader import peek_layer_heads

    counts = peek_layer_heads(model)
    if counts is not None:
        try:
            parse_heads(heads, len(counts), counts)
        except InputError as e:
            raise InputError(f"{option} {heads} is out of range: {e}") from None


__all__ = ["check_head", "check_heads_in_config", "parse_heads", "per_layer_counts"]
