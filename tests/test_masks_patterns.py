"""Sparse patterns as mask functions: semantics, exact block classifiers, parsing, bad input."""

from __future__ import annotations

import pytest
import torch

from headlab import masks
from headlab.spec.blocks import BlockMap, _classify_dense, block_map
from headlab.errors import ConfigError, MaskError
from conftest import run_cli as _cli


def _dense_state(m, lq, lk, bq, bk, batch=1, heads=1):
    """Block states from the dense evaluation (the foundation's generic classifier)."""
    return _classify_dense(m, lq, lk, bq, bk, batch, heads, torch.device("cpu"))


# (name, mask, q_len, kv_len, heads): every pattern, odd lengths, q_len != kv_len where allowed
PATTERN_CASES = [
    ("sliding", masks.sliding_window(5), 37, 37, 1),
    ("sliding_causal", masks.sliding_window(7, causal=True), 41, 29, 1),
    ("sliding_wider_than_seq", masks.sliding_window(1000), 23, 31, 1),
    ("dilated", masks.dilated_window(3, 2), 40, 40, 1),
    ("dilated_causal", masks.dilated_window(2, 3, causal=True), 33, 45, 1),
    ("strided", masks.strided(6), 50, 50, 1),
    ("strided_noncausal", masks.strided(4, causal=False), 27, 35, 1),
    ("fixed", masks.fixed(8, 2), 53, 53, 1),
    ("fixed_noncausal", masks.fixed(5, 1, causal=False), 31, 44, 1),
    ("fixed_c_eq_l", masks.fixed(4, 4), 19, 19, 1),
    ("global", masks.global_tokens([0, 17, 30, 40]), 33, 41, 1),
    ("bigbird", masks.bigbird(4, 3, 1, 2, seed=3), 45, 45, 1),
    ("bigbird_rect", masks.bigbird(5, 1, 0, 1, seed=1), 23, 38, 1),
    ("bigbird_block_gt_seq", masks.bigbird(64, 3, 2, 2), 20, 20, 1),
    ("layout", masks.block_layout(torch.rand(5, 4, generator=torch.Generator().manual_seed(0)) > 0.5, (7, 9)),
     33, 30, 1),
    ("layout_heads", masks.block_layout(torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(1)) > 0.4, 6),
     24, 20, 3),
    ("documents", masks.documents([5, 1, 12, 9, 3]), 30, 30, 1),
    ("causal", masks.causal(), 29, 37, 1),
]

TILES = [(1, 1), (4, 4), (3, 5), (8, 8), (16, 7), (64, 64)]


@pytest.mark.parametrize("name, m, lq, lk, heads", PATTERN_CASES, ids=[c[0] for c in PATTERN_CASES])
def test_closed_form_blocks_match_dense(name, m, lq, lk, heads):
    for bq, bk in TILES:
        hint = m.block_hint(lq, lk, bq, bk, torch.device("cpu"))
        assert hint is not None, f"{name} has no closed form"
        dense = _dense_state(m, lq, lk, bq, bk, heads=heads)
        hint = hint.expand_as(dense)
        assert torch.equal(hint.to(torch.int8), dense), f"{name} tiles {bq}x{bk} differ"


# compositions: the classifier may be conservative, never wrong (no visible tile EMPTY, no hidden FULL)
COMPOSED = [
    ("window_or_global", masks.sliding_window(3) | masks.global_tokens([0, 9]), 40, 40),
    ("window_and_causal", masks.sliding_window(4) & masks.causal(), 35, 35),
    ("docs_and_causal", masks.documents([7, 10, 3]) & masks.causal(), 20, 20),
    ("not_window", ~masks.sliding_window(2), 17, 17),
    ("strided_or_fixed", masks.strided(4) | masks.fixed(4), 33, 33),
]


@pytest.mark.parametrize("name, m, lq, lk", COMPOSED, ids=[c[0] for c in COMPOSED])
def test_composed_blocks_are_conservative(name, m, lq, lk):
    for bq, bk in TILES:
        got = block_map(m, lq, lk, bq, bk).state[0, 0]
        exact = _dense_state(m, lq, lk, bq, bk)[0, 0]
        assert not ((got == 0) & (exact != 0)).any(), f"{name}: visible tile called EMPTY"
        assert not ((got == 2) & (exact != 2)).any(), f"{name}: partly hidden tile called FULL"
    # the dense form is the boolean combination
    a = m.dense(q_len=lq, kv_len=lk)
    assert a.dtype == torch.bool and a.shape[-2:] == (lq, lk)


def test_semantics_by_brute_force():
    n = 24
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    d = i - j
    expected = {
        "sliding_window:3": d.abs() <= 3,
        "sliding_window:3:causal": (d >= 0) & (d <= 3),
        "dilated_window:2:3": (d.abs() <= 6) & (d % 3 == 0),
        "strided:5": (d >= 0) & ((d <= 5) | (d % 5 == 0)),
        "fixed:6:2": (j <= i) & ((i // 6 == j // 6) | (j % 6 >= 4)),
        "global_tokens:0,7": (i == 0) | (i == 7) | (j == 0) | (j == 7),
        "documents:10,14&causal": (j <= i) & ((i < 10) == (j < 10)),
        "sliding_window:2|global_tokens:0": (d.abs() <= 2) | (i == 0) | (j == 0),
        "~causal": j > i,
        "(sliding_window:1|sliding_window:5)&causal": (d >= 0) & (d <= 5),
    }
    for spec, want in expected.items():
        got = masks.from_string(spec).dense(q_len=n)[0, 0]
        assert torch.equal(got, want), spec


def test_bigbird_pattern():
    m = masks.bigbird(4, window_blocks=3, global_blocks=1, random_blocks=2, seed=7)
    a = m.dense(q_len=40)[0, 0]
    cells = a[::4, ::4]  # one entry per (block row, block column)
    assert torch.equal(a, cells.repeat_interleave(4, 0).repeat_interleave(4, 1))  # constant on blocks
    assert cells[0].all() and cells[:, 0].all()  # the global block
    n = cells.shape[0]
    band = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() <= 1
    assert cells[band].all()
    extra = (cells & ~band)[1:, 1:].sum(1)  # random blocks outside the window and the global block
    assert (extra <= 2).all() and extra.sum() > 0
    # deterministic for a seed, different for another
    assert torch.equal(a, masks.bigbird(4, 3, 1, 2, seed=7).dense(q_len=40)[0, 0])
    assert not torch.equal(a, masks.bigbird(4, 3, 1, 2, seed=8).dense(q_len=40)[0, 0])
    # counts above the number of blocks are clamped: everything visible
    assert masks.bigbird(4, 1, 0, 100).dense(q_len=12).all()


def test_block_layout_per_head_and_batch():
    lay = torch.zeros(2, 3, 3, dtype=torch.bool)
    lay[0] = torch.eye(3, dtype=torch.bool)
    lay[1, :, 0] = True
    m = masks.block_layout(lay, 2)
    d = m.dense(batch=1, heads=2, q_len=5)
    assert d.shape == (1, 2, 5, 5)
    assert torch.equal(d[0, 0, 4], torch.tensor([0, 0, 0, 0, 1], dtype=torch.bool))
    assert torch.equal(d[0, 1, 2], torch.tensor([1, 1, 0, 0, 0], dtype=torch.bool))
    with pytest.raises(MaskError, match="built for 2 heads"):
        m.dense(heads=4, q_len=5)


BAD_INPUT = [
    (lambda: masks.sliding_window(0), ConfigError, "positive"),
    (lambda: masks.sliding_window(-3), ConfigError, "positive"),
    (lambda: masks.sliding_window(2.5), ConfigError, "integer"),
    (lambda: masks.dilated_window(4, 0), ConfigError, "dilation"),
    (lambda: masks.strided(0), ConfigError, "stride"),
    (lambda: masks.fixed(-1, 1), ConfigError, "stride"),
    (lambda: masks.fixed(4, 5), ConfigError, "summary"),
    (lambda: masks.fixed(4, 0), ConfigError, "summary"),
    (lambda: masks.bigbird(0), ConfigError, "block"),
    (lambda: masks.bigbird(8, 2), ConfigError, "odd"),
    (lambda: masks.bigbird(8, 3, -1), ConfigError, "global_blocks"),
    (lambda: masks.bigbird(8, 3, 1, -2), ConfigError, "random_blocks"),
    (lambda: masks.global_tokens([]), ConfigError, "at least one"),
    (lambda: masks.global_tokens([-1]), ConfigError, ">= 0"),
    (lambda: masks.global_tokens([99]).dense(q_len=16), MaskError, "every index is outside the sequence"),
    (lambda: block_map(masks.global_tokens([16, 20]), 16, 16, 4, 4), MaskError, "indices must be < 16"),
    (lambda: masks.documents([3, 0]), ConfigError, ">= 1"),
    (lambda: masks.documents([]), ConfigError, "at least one"),
    (lambda: masks.block_layout(torch.ones(2, 2), 0), MaskError, "boolean"),
    (lambda: masks.block_layout(torch.ones(2, 2, dtype=torch.bool), 0), ConfigError, "block_q"),
    (lambda: masks.block_layout(torch.ones(2, dtype=torch.bool), 4), MaskError, "shape"),
    # shape mismatch is found when the length is known
    (lambda: masks.block_layout(torch.ones(2, 2, dtype=torch.bool), 4).dense(q_len=12), MaskError, "3 x 3"),
    (lambda: block_map(masks.block_layout(torch.ones(2, 2, dtype=torch.bool), 4), 12, 12, 4, 4), MaskError,
     "3 x 3"),
    (lambda: masks.documents([3, 4]).dense(q_len=8), MaskError, "add up"),
    (lambda: masks.from_string("sliding_window"), ConfigError, "sliding_window:window"),
    (lambda: masks.from_string("sliding_window:0"), ConfigError, "positive"),
    (lambda: masks.from_string("nope:3"), ConfigError, "known patterns: full, causal"),
    (lambda: masks.from_string("causal&"), ConfigError, "missing a pattern"),
    (lambda: masks.from_string("(causal"), ConfigError, "parentheses"),
    (lambda: masks.from_string("sliding_window:abc"), ConfigError, "cannot read"),
    (lambda: masks.from_string(""), ConfigError, "non-empty"),
]


@pytest.mark.parametrize("make, exc, match", BAD_INPUT, ids=[str(i) for i in range(len(BAD_INPUT))])
def test_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_sizes_larger_than_sequence_are_documented_clamps():
    assert masks.sliding_window(500).dense(q_len=9).all()
    assert torch.equal(masks.strided(100).dense(q_len=9)[0, 0], masks.causal().dense(q_len=9)[0, 0])
    assert masks.bigbird(100, 1, 0, 0).dense(q_len=9).all()


def test_empty_rows_are_allowed():
    m = masks.block_layout(torch.tensor([[False, True], [False, False]]), 3)
    d = m.dense(q_len=6)[0, 0]
    assert not d[3:].any() and d[:3, 3:].all()
    bm = block_map(m, 6, 6, 3, 3)
    assert bm.state[0, 0].tolist() == [[0, 2], [0, 0]]


def test_from_string_matches_constructors_and_exports():
    pairs = [
        ("bigbird:8:3:2:2:0", masks.bigbird(8, 3, 2, 2, 0)),
        ("fixed:8:2:causal=false", masks.fixed(8, 2, causal=False)),
        ("dilated_window:3:2", masks.dilated_window(3, 2)),
        ("padding:5", masks.padding([5])),
    ]
    for spec, m in pairs:
        assert torch.equal(masks.from_string(spec).dense(q_len=20), m.dense(q_len=20)), spec
    import headlab
    import headlab.spec.masks as inner

    assert headlab.masks is inner is masks  # one module object, the pattern table included
    for name in inner.__all__:
        assert getattr(masks, name) is getattr(inner, name)
    assert set(masks.pattern_names()) >= {"sliding_window", "bigbird", "documents", "causal"}


def test_block_map_uses_closed_form_fast():
    # the closed form never evaluates the n x n mask: a 128k-token window compiles in O(tiles)
    m = masks.sliding_window(256)
    bm = block_map(m, 1 << 17, 1 << 17, 128, 128)
    assert isinstance(bm, BlockMap)
    assert bm.visited_tiles() == 5 * 1024 - 6  # 5 key blocks per query block, fewer at the ends


# -- the `headlab pattern` command ------------------------------------------------------------


def test_cli_pattern_help(capsys):
    code, out, _ = _cli(["pattern", "--help"], capsys)
    assert code == 0 and "--window" in out and "--png" in out and "--lengths" in out


def test_cli_pattern_draws_window(capsys):
    code, out, _ = _cli(["pattern", "sliding_window", "--window", "4", "--seq-len", "32"], capsys)
    assert code == 0
    rows = [line for line in out.splitlines() if set(line) <= {"█", "·"} and line]
    assert len(rows) == 32
    drawn = torch.tensor([[c == "█" for c in r] for r in rows])
    assert torch.equal(drawn, masks.sliding_window(4).dense(q_len=32)[0, 0])
    assert "26.2% of pairs visible" in out and "tiles of 4x4 visited" in out


def test_cli_pattern_json_and_spec(capsys):
    import json

    code, out, _ = _cli(["pattern", "sliding_window:2&causal", "-n", "16", "--json"], capsys)
    assert code == 0
    info = json.loads(out)
    assert info["visible_pairs"] == int(masks.from_string("sliding_window:2&causal").dense(q_len=16).sum())
    code, out, _ = _cli(["pattern", "documents", "--lengths", "3,5", "-n", "8", "--causal", "--json"], capsys)
    assert json.loads(out)["visible_pairs"] == 6 + 15


def test_cli_pattern_png(tmp_path, capsys):
    path = tmp_path / "bb.png"
    code, out, _ = _cli(["pattern", "bigbird", "--block", "4", "--seq-len", "64", "--png", str(path)], capsys)
    assert code == 0 and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


CLI_ERRORS = [
    (["pattern", "banana"], "known patterns: full, causal"),
    (["pattern", "sliding_window"], "needs --window"),
    (["pattern", "sliding_window", "--window", "0"], "positive"),
    (["pattern", "strided", "--stride", "-2"], "positive"),
    (["pattern", "documents", "--lengths", "3,4", "-n", "9"], "add up"),
    (["pattern", "sliding_window", "--window", "2", "-n", "0"], "--seq-len"),
    (["pattern", "global_tokens", "--global", "x"], "comma-separated"),
]


@pytest.mark.parametrize("args, message", CLI_ERRORS, ids=[" ".join(a[1:]) for a, _ in CLI_ERRORS])
def test_cli_pattern_errors(args, message, capsys):
    code, _, err = _cli(args, capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) <= 2
