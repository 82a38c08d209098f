"""Which heads a report names and draws: ``--heads`` parsed and checked (per-layer head counts of
a pruned model included), the heads drawn by default, the clearest example of each label, and how
many maps the page can embed."""

from __future__ import annotations

from collections.abc import Sequence

from headlab.interpret.heads.labels import HeadRecord
from headlab.interpret.heads.naming import check_head, parse_heads, per_layer_counts  # noqa: F401  (public here too)

DRAWN_HEADS = 4  # heads drawn by default in the streaming mode
MAX_EMBEDDED_BYTES = 64 << 20  # the page embeds at most this much of maps (2 bytes a weight); the rest are PNGs only


def interesting_heads(records: Sequence[HeadRecord]) -> list[tuple[str, HeadRecord]]:
    """For each label some head carries, the head with the strongest evidence for it.

    Strength: the argmax share for positional labels, the sink mass for separator-sink, the
    normalised entropy for broad.
    """
    strength = {
        "previous-token": lambda r: r.prev_share,
        "next-token": lambda r: r.next_share,
        "self": lambda r: r.self_share,
        "broad": lambda r: r.norm_entropy,
        "separator-sink": lambda r: r.mass_first + (r.mass_sep or 0.0),
    }
    out = []
    for label, key in strength.items():
        carriers = [r for r in records if label in r.labels]
        if carriers:
            out.append((label, max(carriers, key=key)))
    return out


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


__all__ = [
    "DRAWN_HEADS",
    "MAX_EMBEDDED_BYTES",
    "check_head",
    "default_drawn_heads",
    "embeddable",
    "heads_text",
    "interesting_heads",
    "parse_heads",
]
