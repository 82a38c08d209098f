"""``masks.band_of``: a mask's band of visible offsets ``q_idx - kv_idx``, read from its structure,
against the band found by brute force on the dense boolean matrix of the mask at several shapes."""

from __future__ import annotations

import pytest
import torch

from headlab import masks

# (name, mask, band_of's answer): compositions of every node (&, |, ~) and the leaves
CASES = [
    ("full", masks.full(), (None, None)),
    ("causal", masks.causal(), (0, None)),
    ("window_3", masks.sliding_window(3), (-3, 3)),
    ("window_3_causal", masks.sliding_window(3, causal=True), (0, 3)),
    ("causal_and_window", masks.causal() & masks.sliding_window(3), (0, 3)),
    ("window_and_causal", masks.sliding_window(4) & masks.causal(), (0, 4)),
    ("overlapping_windows", masks.sliding_window(2) | masks.sliding_window(4, causal=True), (-2, 4)),
    ("touching_windows", masks.sliding_window(1, causal=True) | (~masks.causal() & masks.sliding_window(2)), (-2, 1)),
    ("disjoint_windows", (masks.sliding_window(6, causal=True) & ~masks.sliding_window(3)) | masks.sliding_window(1),
     None),
    ("not_causal", ~masks.causal(), (None, -1)),
    ("not_not_causal", ~~masks.causal(), (0, None)),
    ("not_window", ~masks.sliding_window(2), None),
    ("future_window", ~masks.causal() & masks.sliding_window(3), (-3, -1)),
    ("far_past", ~masks.sliding_window(3) & masks.sliding_window(5, causal=True), (4, 5)),
    ("two_gaps", ~(masks.sliding_window(1) | ~masks.sliding_window(4)), None),
    ("causal_and_not_causal", masks.causal() & ~masks.causal(), None),
    ("empty_or_window", (masks.causal() & ~masks.causal()) | masks.sliding_window(2), (-2, 2)),
    ("window_or_everything", masks.sliding_window(1) | ~masks.sliding_window(1), (None, None)),
    ("not_full", ~masks.full(), None),
    ("dilated_1", masks.dilated_window(3, 1), (-3, 3)),
    ("dilated_2", masks.dilated_window(2, 2), None),
    ("strided", masks.strided(4), None),
    ("padding_and_causal", masks.causal() & masks.padding([9]), None),
    ("full_and_padding", masks.full() & masks.padding([9]), None),
    ("lower_right", masks.causal_lower_right(), None),  # a band at each shape, but a different one
    ("plain_function", masks.as_mask(lambda b, h, q, kv: q >= kv), None),  # nothing declared: not read
]
SHAPES = [(12, 12), (7, 13), (13, 7)]  # (q_len, kv_len)


def brute_band(mask, q_len: int, kv_len: int) -> tuple[int, int] | None:
    """``(min, max)`` of the visible offsets when the dense matrix is exactly the offsets in that range
    (a diagonal is all visible or all hidden, and the visible ones are consecutive), else None."""
    dense = mask.dense(batch=1, heads=1, q_len=q_len, kv_len=kv_len)[0, 0]
    if mask.batch_dependent or mask.head_dependent:
        return None
    off = torch.arange(q_len)[:, None] - torch.arange(kv_len)[None, :]  # (Lq, Lk): i - j
    seen = sorted({int(d) for d in off[dense]})
    if not seen or seen != list(range(seen[0], seen[-1] + 1)):
        return None
    lo, hi = seen[0], seen[-1]
    return (lo, hi) if torch.equal(dense, (off >= lo) & (off <= hi)) else None


def explained_by_one_band(found: dict) -> bool:
    """Whether one band ``(lo, hi)`` (None = unbounded) gives, cut to each shape's offsets, what brute force found
    at every shape: an end that lies inside a shape's range fixes it, an end at the range's edge only bounds it."""
    if any(b is None for b in found.values()):
        return False
    for side in (0, 1):
        fixed, bounds = set(), []
        for (lq, lk), band in found.items():
            edge = -(lk - 1) if side == 0 else lq - 1
            if band[side] == edge:
                bounds.append(edge)  # lo <= edge (or hi >= edge): anything beyond fits
            else:
                fixed.add(band[side])
        if len(fixed) > 1 or (fixed and any((v < next(iter(fixed))) if side == 0 else (v > next(iter(fixed)))
                                            for v in bounds)):
            return False
    return True


def clip(band, q_len: int, kv_len: int) -> tuple[int, int] | None:
    lo = -(kv_len - 1) if band[0] is None else max(band[0], -(kv_len - 1))
    hi = q_len - 1 if band[1] is None else min(band[1], q_len - 1)
    return (lo, hi) if lo <= hi else None


@pytest.mark.parametrize("name,mask,band", CASES, ids=[c[0] for c in CASES])
def test_band_of_equals_brute_force(name, mask, band):
    assert masks.band_of(mask) == band
    found = {(lq, lk): brute_band(mask, lq, lk) for lq, lk in SHAPES}
    if band is not None:
        assert found == {(lq, lk): clip(band, lq, lk) for lq, lk in SHAPES}
    else:  # no single band: brute force finds none at some shape, or different ones
        assert not explained_by_one_band(found), found


def test_band_is_not_an_attribute_of_the_mask():
    """The band is computed from the mask, so a composition keeps it; constructors set no ``band``."""
    for mask in (masks.causal(), masks.sliding_window(3), masks.causal() & masks.sliding_window(3)):
        assert not hasattr(mask, "band")
    assert masks.band_of(None) is None and masks.band_of(torch.ones(1, 1, 4, 4, dtype=torch.bool)) is None
