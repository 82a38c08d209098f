"""headlab.attention.backends.sparse.plan.pattern_density against a brute-force count on the dense mask,
and the spec the ``headlab pattern`` options stand for (headlab.interpret.instruments.pattern.spec) against the constructors."""

from __future__ import annotations

import pytest
import torch

from headlab import masks
from headlab.attention.backends.sparse.plan import BLOCK_Q, default_tile, pattern_density
from headlab.interpret.instruments.pattern import build, spec
from headlab.errors import ConfigError

# (mask, seq_len, tile): tiles that do not divide the length, one tile, tiles of one position
DENSITY_CASES = {
    "causal_7": (masks.causal(), 30, 7),
    "window_3_by_1": (masks.sliding_window(3), 11, 1),
    "window_whole": (masks.sliding_window(2, causal=True), 13, 13),
    "bigbird": (masks.bigbird(4, random_blocks=1, seed=3), 37, 5),
    "documents_gap": (masks.documents([5, 9, 3]) & masks.causal(), 17, 4),
    "global_or_window": (masks.global_tokens([0, 9]) | masks.sliding_window(1), 20, 6),
    "dead_rows": (masks.causal() & ~masks.global_tokens([0, 1]) & masks.sliding_window(1), 9, 2),
}


def _brute(dense: torch.Tensor, tile: int) -> tuple[int, int, int]:
    """(tiles, visited, full) of a (L, L) bool map, tile by tile."""
    L = dense.shape[0]
    tiles = visited = full = 0
    for i in range(0, L, tile):
        for j in range(0, L, tile):
            t = dense[i:i + tile, j:j + tile]
            tiles += 1
            visited += bool(t.any())
            full += bool(t.all())
    return tiles, visited, full


@pytest.mark.parametrize("name", list(DENSITY_CASES))
def test_density_counts_what_the_dense_mask_shows(name):
    mask, L, tile = DENSITY_CASES[name]
    d = pattern_density(mask, L, tile=tile)
    dense = mask.dense(q_len=L)[0, 0]  # (L, L)
    assert torch.equal(d.visible, dense)
    assert d.visible_pairs == int(dense.sum()) and d.pair_density == int(dense.sum()) / L**2
    assert (d.tiles, d.visited_tiles, d.full_tiles) == _brute(dense, tile)
    assert d.tile_density == d.visited_tiles / d.tiles and d.full_tile_share == d.full_tiles / d.tiles
    assert d.rows_without_keys == int((dense.sum(-1) == 0).sum())


def test_dead_rows_are_counted():
    d = pattern_density(DENSITY_CASES["dead_rows"][0], 9, tile=2)
    assert d.rows_without_keys == 2  # queries 0 and 1 see only keys 0 and 1, which are removed


def test_default_tile_is_the_kernel_tile_or_an_eighth():
    assert default_tile(1) == 1 and default_tile(64) == 8 and default_tile(1 << 14) == BLOCK_Q
    assert pattern_density(masks.causal(), 64).tile == 8


def test_density_of_one_head_of_a_per_head_layout():
    layout = torch.zeros(2, 2, 2, dtype=torch.bool)  # (heads, q blocks, k blocks)
    layout[0] = torch.eye(2, dtype=torch.bool)
    layout[1] = True
    m = masks.block_layout(layout, block=3)
    assert pattern_density(m, 6, tile=3, head=0).visited_tiles == 2
    assert pattern_density(m, 6, tile=3, head=1).visited_tiles == 4
    with pytest.raises(ConfigError, match=r"head must be in 0..1 .* got 2"):
        pattern_density(m, 6, head=2)


@pytest.mark.parametrize("kwargs, message", [({"seq_len": 0}, "seq_len must be positive"),
                                             ({"seq_len": 8, "tile": 0}, "tile must be positive")])
def test_density_refuses_bad_sizes(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        pattern_density(masks.causal(), **kwargs)


# -- the command's options as a spec: the constructors' own masks ---------------------------------------------

SPEC_CASES = [
    ("sliding_window", {"window": 4}, "sliding_window:window=4", masks.sliding_window(4)),
    ("sliding_window", {"window": 4, "causal": True}, "sliding_window:window=4:causal=true",
     masks.sliding_window(4, causal=True)),
    ("dilated_window", {"window": 3, "dilation": 3}, "dilated_window:window=3:dilation=3", masks.dilated_window(3, 3)),
    ("strided", {"stride": 4}, "strided:stride=4", masks.strided(4)),
    ("fixed", {"stride": 4, "summary": 2, "causal": True}, "fixed:stride=4:summary=2:causal=true", masks.fixed(4, 2)),
    ("bigbird", {"block": 4, "global_": "1", "random": 3, "seed": 5},
     "bigbird:block=4:window_blocks=3:global_blocks=1:random_blocks=3:seed=5", masks.bigbird(4, 3, 1, 3, 5)),
    ("global_tokens", {"global_": "0, 5"}, "global_tokens:indices=0, 5", masks.global_tokens([0, 5])),
    ("documents", {"lengths": "3,5", "causal": True}, "documents:lengths=3,5&causal",
     masks.documents([3, 5]) & masks.causal()),
    ("causal", {"causal": True}, "causal&causal", masks.causal()),
    ("sliding_window:2|global_tokens:0", {"causal": True}, "(sliding_window:2|global_tokens:0)&causal",
     (masks.sliding_window(2) | masks.global_tokens([0])) & masks.causal()),
]


@pytest.mark.parametrize("name, options, text, want", SPEC_CASES, ids=[c[2] for c in SPEC_CASES])
def test_options_become_a_spec_of_the_same_mask(name, options, text, want):
    assert spec(name, **options) == text
    L = 8 if name.startswith("documents") else 23
    assert torch.equal(build(name, **options).dense(q_len=L), want.dense(q_len=L))


@pytest.mark.parametrize("name, options, message", [
    ("banana", {}, "known patterns: full, causal"),
    ("sliding_window", {}, "needs --window"),
    ("global_tokens", {"global_": "0:5"}, "--global must be comma-separated integers such as 0,5,9; got '0:5'"),
    ("documents", {"lengths": "3&causal"}, "--lengths must be comma-separated integers"),
])
def test_bad_options_name_the_option(name, options, message):
    with pytest.raises(ConfigError, match=message):
        spec(name, **options)
