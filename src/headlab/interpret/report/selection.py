"""Which heads a report names and draws: ``--heads`` parsed and checked (per-layer head counts of
a pruned model included), the heads drawn by default, the clearest example of each label, and how
many maps the page can embed."""

from __future__ import annotations

from collections.abc import Sequence

from headlab.errors import InputError
from headlab.interpret.heads.labels import HeadRecord
from headlab.interpret.report.html import per_layer_counts

DRAWN_HEADS = 4  # heads drawn by default in the streaming mode
MAX_EMBEDDED_BYTES = 64 << 20  # the page embeds at most this much of maps (2 bytes a weight); the rest are PNGs only


def interesting_heads(records: Sequence[HeadRecord]) -> list[tuple[str, HeadRecord]]:
    """For each label some head carries, the head with the strongest evidence for it.

    Strength: the argmax share for positional labels, the sink mass for separator-sink, the
    normalised entropy for broad.
    """
    strength = {
        "previous-token": lambda r: r.prev_share, "next-token": lambda r: r.next_share,
        "self": lambda r: r.self_share, "broad": lambda r: r.norm_entropy,
        "separator-sink": lambda r: r.mass_first + (r.mass_sep or 0.0),
    }
    out = []
    for label, key in strength.items():
        carriers = [r for r in records if label in r.labels]
        if carriers:
            out.append((label, max(carriers, key=key)))
    return out


def parse_heads(spec: str | Sequence[tuple[int, int]] | None, n_layers: int,
                n_heads: int | Sequence[int]) -> list[tuple[int, int]] | None:
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
        which = f"heads 0..{counts[layer] - 1}" if len(set(counts)) == 1 else \
            f"heads 0..{counts[layer] - 1} in layer {layer} (a pruned model: heads per layer {counts})"
        raise InputError(f"head {layer}.{head} does not exist: the model has layers 0..{n_layers - 1} and {which}")


def default_drawn_heads(records: Sequence[HeadRecord], count: int = DRAWN_HEADS) -> list[tuple[int, int]]:
    """The ``count`` heads whose rows most often point at a fixed offset (previous, next, self):
    the patterns still readable on a long map. Ties go to the lower normalised entropy."""
    ranked = sorted(records, key=lambda r: (-max(r.prev_share, r.next_share, r.self_share), r.norm_entropy))
    return sorted((r.layer, r.head) for r in ranked[:count])


def embeddable(n: int, count: int) -> int:
    """How many of ``count`` maps of ``n`` tokens the page embeds: those that fit in
    :data:`MAX_EMBEDDED_BYTES` at 2 bytes a weight (every drawn map is in the PNGs either way).

    >>> embeddable(512, 72), embeddable(3500, 4), embeddable(8192, 4)
    (72, 2, 0)
    """
    return min(count, MAX_EMBEDDED_BYTES // (2 * n * n))


def heads_text(counts: Sequence[int]) -> str:
    """``"12"``, or ``"11-12 (per layer: 11, 12, ...)"`` for a pruned model."""
    if len(set(counts)) == 1:
        return str(counts[0])
    return f"{min(counts)}-{max(counts)} (per layer: {', '.join(map(str, counts))})"


__all__ = ["DRAWN_HEADS", "MAX_EMBEDDED_BYTES", "check_head", "default_drawn_heads", "embeddable", "heads_text",
           "interesting_heads", "parse_heads"]
