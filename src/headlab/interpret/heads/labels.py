"""The per-head table: statistics of each head's attention and simple pattern labels with evidence.

Pure functions of arrays, no model. Two ways in, one way out:

- :func:`row_stats_from_maps` reads full attention maps ``(heads, q_len, k_len)`` of one layer;
- :func:`row_stats_from_attention_stats` reads the streaming statistics of
  :func:`headlab.attention_stats` (no ``n x n`` map anywhere);

both give a :class:`RowStats` (one number per head and query row, plus the weight each key
receives), and :func:`head_records` turns the rows of every layer into one :class:`HeadRecord`
per head. The two ways agree to float precision, which the tests check.

What a row statistic means, for query row ``i`` with weights ``P[i, :]`` (a probability vector):

- entropy ``H_i = -sum_j P_ij ln P_ij`` (nats); normalised entropy ``H_i / ln(visible keys)``
  (1 = uniform over every key the row can see, 0 = all weight on one key);
- mean attended distance ``sum_j P_ij |i - j|`` (in tokens);
- confidence ``max_j P_ij`` (Voita et al. 2019);
- argmax ``argmax_j P_ij`` (the first on ties);
- mass on chosen key positions ``P[i, positions]`` (the first token and the separators).

Every table statistic is the mean over all query rows; the most attended token is the key with the
largest total weight ``sum_i P_ij`` over all rows.

Labels (a head can carry several, or none), thresholds in :class:`LabelThresholds`:

==================  =========================================================================
previous-token      share of rows whose argmax is key ``i - 1`` >= ``positional`` (0.5);
                    counted over the rows that have a previous token
next-token          the same at offset ``+1`` (rows that have a next token)
self                the same at offset ``0``
separator-sink      mean weight per row on [CLS] + every [SEP] (the first token for decoders)
                    >= ``sink`` (0.5)
broad               mean normalised entropy >= ``broad`` (0.7), over rows that see >= 2 keys
==================  =========================================================================

These are patterns of one text, not the head atlas's kinds (:mod:`headlab.interpret.atlas`), which
score a head by its paper's definition on the atlas's own inputs: the atlas's ``previous_token`` is the
*mean weight* one step back on random tokens repeated once (from its own threshold), while the label
previous-token here is the *share of rows* whose largest weight is one step back on this text (from
``positional``). A head can carry one and not the other; the pages name them apart ("pattern labels",
"(pattern)" beside the atlas's roles) and say how each is measured.

Example, a previous-token head on four tokens:

    >>> import numpy as np
    >>> P = np.array([[1.0, 0, 0, 0], [0.9, 0.1, 0, 0], [0, 0.8, 0.2, 0], [0, 0, 0.7, 0.3]])
    >>> rows = row_stats_from_maps(P[None], sink_positions=[0])    # (heads=1, 4, 4)
    >>> rec = head_records([rows], ["[CLS]", "a", "b", "c"], separator_positions=[])[0]
    >>> rec.labels, rec.evidence[0]
    (('previous-token',), 'previous-token: 100% of rows argmax at offset -1 (3 of 3 rows)')
    >>> round(rec.mean_distance, 3)
    0.6
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Sequence

import numpy as np

from headlab.errors import ShapeError

LABELS = ("previous-token", "next-token", "self", "separator-sink", "broad")
_OFFSETS = {"previous-token": -1, "next-token": +1, "self": 0}


@dataclass(frozen=True)
class LabelThresholds:
    """When a head earns a label. Defaults follow the literature's round numbers (Clark et al.
    2019 report heads with more than half their attention on the previous token or on [SEP])."""

    positional: float = 0.5  # share of rows whose argmax sits at the offset (-1, +1 or 0)
    sink: float = 0.5  # mean weight per row on [CLS] + [SEP] (first token for decoders)
    broad: float = 0.7  # mean entropy / ln(visible keys); 1 = uniform


@dataclass(frozen=True)
class RowStats:
    """Per-row statistics of one layer for one sequence: everything the head table needs.

    Shapes (H heads, Lq query rows, Lk keys, n chosen key positions):
    ``entropy, max_weight, mean_distance`` float ``(H, Lq)``; ``argmax`` int ``(H, Lq)``;
    ``sink_mass`` float ``(H, Lq, n)`` (weight on ``sink_positions``); ``received`` float
    ``(H, Lk)`` (column sums); ``visible`` int ``(Lq,)`` (keys each row may attend to).
    """

    entropy: np.ndarray
    max_weight: np.ndarray
    argmax: np.ndarray
    mean_distance: np.ndarray
    sink_mass: np.ndarray
    received: np.ndarray
    visible: np.ndarray
    sink_positions: tuple[int, ...]

    @property
    def n_heads(self) -> int:
        return int(self.entropy.shape[0])


def visible_keys(q_len: int, k_len: int, causal: bool) -> np.ndarray:
    """Keys each query row sees: all ``k_len``, or ``i + 1`` under a (top-left) causal mask.

    >>> visible_keys(3, 3, causal=True).tolist()
    [1, 2, 3]
    """
    if causal:
        return np.minimum(np.arange(q_len) + 1, k_len)
    return np.full(q_len, k_len)


def row_stats_from_maps(maps, *, sink_positions: Sequence[int], causal: bool = False) -> RowStats:
    """Row statistics from full attention maps of one layer, one sequence.

    Args:
        maps: ``(heads, q_len, k_len)`` attention weights; each row sums to 1 (numpy or torch).
        sink_positions: key positions whose weight is reported (first token, separators).
        causal: whether rows see only keys ``0..i`` (sets the visible-key count for entropy).
    """
    P = np.asarray(maps.detach().cpu() if hasattr(maps, "detach") else maps, dtype=np.float64)
    if P.ndim != 3:
        raise ShapeError(
            f"attention maps must be (heads, q_len, k_len); got shape {P.shape}. "
            "Pass one layer of one sequence, e.g. pattern[0] for pattern (B, H, Lq, Lk)."
        )
    _, lq, lk = P.shape
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(P > 0, P * np.log(np.where(P > 0, P, 1.0)), 0.0)
    dist = np.abs(np.arange(lq)[:, None] - np.arange(lk)[None, :])  # (Lq, Lk)
    pos = list(sink_positions)
    return RowStats(
        entropy=-plogp.sum(-1),
        max_weight=P.max(-1),
        argmax=P.argmax(-1),
        mean_distance=(P * dist).sum(-1),
        sink_mass=P[:, :, pos] if pos else np.zeros(P.shape[:2] + (0,)),
        received=P.sum(1),
        visible=visible_keys(lq, lk, causal),
        sink_positions=tuple(int(p) for p in pos),
    )


def row_stats_from_attention_stats(
    stats, *, sink_positions: Sequence[int], causal: bool = False, batch_index: int = 0
) -> RowStats:
    """Row statistics from :func:`headlab.attention_stats` output (streaming; no ``n x n`` map).

    ``stats`` must have been computed with ``key_positions=sink_positions``; its fields are
    ``(B, H, Lq)`` tensors (``key_mass`` ``(B, H, Lq, n)``, ``received`` ``(B, H, Lk)``).
    """

    def np_(t):
        return np.asarray(t[batch_index].detach().cpu().double() if hasattr(t, "detach") else t[batch_index])

    entropy = np_(stats.entropy)
    lq, lk = entropy.shape[1], np_(stats.received).shape[1]
    pos = list(sink_positions)
    key_mass = getattr(stats, "key_mass", None)
    sink = np_(key_mass) if (key_mass is not None and pos) else np.zeros(entropy.shape + (0,))
    if sink.shape[-1] != len(pos):
        raise ShapeError(
            f"statistics carry mass on {sink.shape[-1]} key positions but {len(pos)} sink "
            f"positions were named ({pos}); compute them with key_positions={pos}."
        )
    return RowStats(
        entropy=entropy,
        max_weight=np_(stats.max_weight),
        argmax=np_(stats.argmax).astype(np.int64),
        mean_distance=np_(stats.mean_distance),
        sink_mass=sink,
        received=np_(stats.received),
        visible=visible_keys(lq, lk, causal),
        sink_positions=tuple(int(p) for p in pos),
    )


@dataclass(frozen=True)
class HeadRecord:
    """One row of the per-head table. Means are over all query rows of the sequence."""

    layer: int
    head: int
    entropy: float  # mean row entropy, nats
    norm_entropy: float  # mean of entropy / ln(visible keys), rows that see >= 2 keys; 0..1
    mean_distance: float  # mean of sum_j P_ij |i - j|, tokens
    confidence: float  # mean of max_j P_ij
    mass_first: float  # mean weight on the first token ([CLS] for encoders)
    mass_sep: float | None  # mean weight on all [SEP] tokens together; None for decoders
    top_token: str  # the key receiving the most weight over all rows
    top_token_pos: int
    top_token_share: float  # that key's total weight / number of rows
    top_content_token: str | None  # the same, ignoring the first token and separators
    top_content_pos: int | None
    top_content_share: float | None
    prev_share: float  # share of rows (that have a previous token) whose argmax is i - 1
    next_share: float  # share of rows (that have a next token) whose argmax is i + 1
    self_share: float  # share of rows whose argmax is i
    labels: tuple[str, ...] = ()
    evidence: tuple[str, ...] = field(default=())  # one sentence per label, same order
    notes: tuple[str, ...] = field(default=())  # findings of other studies about this head (probe, importance...)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["labels"], d["evidence"], d["notes"] = list(self.labels), list(self.evidence), list(self.notes)
        return d

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _offset_share(argmax: np.ndarray, offset: int, k_len: int, visible: np.ndarray) -> tuple[np.ndarray, int]:
    """Share per head of rows whose argmax is ``i + offset``, over rows where that key is visible."""
    i = np.arange(argmax.shape[1])
    target = i + offset
    ok = (target >= 0) & (target < np.minimum(visible, k_len))
    n = int(ok.sum())
    if n == 0:
        return np.zeros(argmax.shape[0]), 0
    return (argmax[:, ok] == target[ok]).mean(1), n


def head_records(
    layers: Sequence[RowStats],
    tokens: Sequence[str],
    *,
    separator_positions: Sequence[int] | None,
    thresholds: LabelThresholds = LabelThresholds(),
) -> list[HeadRecord]:
    """One :class:`HeadRecord` per (layer, head), layer-major.

    Args:
        layers: one :class:`RowStats` per layer; each must carry ``sink_positions`` =
            ``[0] + separator_positions`` (the first token, then the separators).
        tokens: the ``k_len`` token strings (labels for the most attended token).
        separator_positions: key positions of [SEP] tokens; ``None`` for decoders (no separators:
            ``mass_sep`` is then ``None`` and the sink is the first token alone).
        thresholds: when a label is given.
    """
    seps = list(separator_positions or [])
    specials = {0, *seps}
    out: list[HeadRecord] = []
    for li, rs in enumerate(layers):
        if list(rs.sink_positions) != [0] + seps:
            raise ShapeError(
                f"layer {li}: row statistics carry sink positions {list(rs.sink_positions)}, "
                f"expected [0] + separators = {[0] + seps}."
            )
        lq = rs.entropy.shape[1]
        lk = rs.received.shape[1]
        if len(tokens) != lk:
            raise ShapeError(f"{len(tokens)} token strings for {lk} key positions; pass one string per token.")
        logv = np.log(np.maximum(rs.visible, 1).astype(np.float64))
        wide = rs.visible >= 2
        norm_ent = (rs.entropy[:, wide] / logv[wide]).mean(1) if wide.any() else np.zeros(rs.n_heads)
        shares = {name: _offset_share(rs.argmax, off, lk, rs.visible) for name, off in _OFFSETS.items()}
        mass_first = rs.sink_mass[:, :, 0].mean(1)
        mass_sep = rs.sink_mass[:, :, 1:].sum(-1).mean(1)
        content = np.array([j not in specials for j in range(lk)])
        for h in range(rs.n_heads):
            recv = rs.received[h]
            top = int(np.argmax(recv))
            if content.any():
                cpos = int(np.flatnonzero(content)[np.argmax(recv[content])])
                ctok, cshare = tokens[cpos], float(recv[cpos] / lq)
            else:
                cpos = ctok = cshare = None  # type: ignore[assignment]  # no content key: the row says so with nulls
            sink_total = float(mass_first[h] + (mass_sep[h] if seps else 0.0))
            labels, evidence = [], []
            for name in ("previous-token", "next-token", "self"):
                share, n = shares[name]
                if n and share[h] >= thresholds.positional:
                    hits = int(round(share[h] * n))
                    labels.append(name)
                    off = _OFFSETS[name]
                    evidence.append(
                        f"{name}: {share[h]:.0%} of rows argmax at offset {off:+d}"
                        if off
                        else f"{name}: {share[h]:.0%} of rows argmax at offset 0"
                    )
                    evidence[-1] += f" ({hits} of {n} rows)"
            if sink_total >= thresholds.sink:
                where = "[CLS]/[SEP]" if seps else "the first token"
                labels.append("separator-sink")
                evidence.append(f"separator-sink: mean {sink_total:.0%} of each row's weight on {where}")
            if norm_ent[h] >= thresholds.broad:
                labels.append("broad")
                evidence.append(
                    f"broad: mean normalised entropy {norm_ent[h]:.2f} "
                    f"(about {math.exp(float(rs.entropy[h].mean())):.1f} keys' worth per row)"
                )
            out.append(
                HeadRecord(
                    layer=li,
                    head=h,
                    entropy=float(rs.entropy[h].mean()),
                    norm_entropy=float(norm_ent[h]),
                    mean_distance=float(rs.mean_distance[h].mean()),
                    confidence=float(rs.max_weight[h].mean()),
                    mass_first=float(mass_first[h]),
                    mass_sep=float(mass_sep[h]) if separator_positions is not None else None,
                    top_token=tokens[top],
                    top_token_pos=top,
                    top_token_share=float(recv[top] / lq),
                    top_content_token=ctok,
                    top_content_pos=cpos,
                    top_content_share=cshare,
                    prev_share=float(shares["previous-token"][0][h]),
                    next_share=float(shares["next-token"][0][h]),
                    self_share=float(shares["self"][0][h]),
                    labels=tuple(labels),
                    evidence=tuple(evidence),
                )
            )
    return out


__all__ = [
    "LABELS",
    "HeadRecord",
    "LabelThresholds",
    "RowStats",
    "head_records",
    "row_stats_from_attention_stats",
    "row_stats_from_maps",
    "visible_keys",
]
