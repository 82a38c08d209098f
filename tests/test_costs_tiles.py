"""Closed-form tile counts (costs/tiles/: interval_count.py, mask_tree.py) against the block maps the kernels walk.

The independent computation is the block map itself: ``sparse.block_map(...)`` (the sparse kernel's
map, ``mask & causal`` under causal) and ``tiled.tile_states(...)`` (the tiled kernel's), whose
non-empty tiles are counted and, for the tiled kernel, weighted by their area with the causal cut.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from headlab import costs, masks
from headlab.attention.backends import sparse as _sparse
from headlab.attention.backends import tiled as _tiled
from headlab.costs.tiles import visited
from headlab.costs.tiles.grid import Grid, Unsupported
from headlab.costs.tiles.interval_count import count_tiles
from headlab.errors import CostModelError, MaskError

from cases import random_composition, random_geometry, visited_entries

# every built-in pattern the parser knows (with arguments that exercise edge cases) ...
PATTERNS = [
    "full", "causal", "causal_lower_right",
    "sliding_window:3", "sliding_window:5:causal", "sliding_window:40",
    "dilated_window:2:3", "dilated_window:3:2:causal",
    "strided:4", "strided:4:causal=false", "strided:1",
    "global_tokens:0,5,6,7,30", "global_tokens:2",
    "documents:10,7,30,30",
    "fixed:3:1", "fixed:4:2:causal=false", "fixed:5:5",
]
# ... and combinations with & | ~
COMBOS = [
    "sliding_window:3|global_tokens:0,9", "~sliding_window:3", "~causal&sliding_window:6",
    "(sliding_window:2|strided:3)&causal", "~(sliding_window:4|global_tokens:1)",
    "documents:10,7,30,30&causal", "documents:10,7,30,30&~sliding_window:2",
    "dilated_window:2:3|causal_lower_right", "~global_tokens:0,1,2,3,9", "strided:3&~causal",
    "~(strided:3&sliding_window:5)|global_tokens:40",
    "fixed:3:1|sliding_window:4", "fixed:4:1&~causal", "fixed:3:2:causal=false&global_tokens:0,20",
    "~strided:1|causal_lower_right", "~(strided:1:causal=false&strided:1)",
]
LENGTHS = [(77, 77), (64, 64), (100, 77), (77, 100), (1, 5), (5, 1)]
TILES = [(4, 4), (8, 16), (16, 8), (3, 5), (7, 7)]


def _block_map_counts(mask, lq, lk, bq, bk, causal):
    """(non-empty tiles of the sparse kernel's map, entries inside the tiled kernel's visited tiles)."""
    eff = _sparse.effective_mask(mask, causal)
    tiles = int((_sparse.block_map(eff, lq, lk, 1, 1, bq, bk).state != 0).sum())
    shape = costs.AttentionShape(heads=1, q_len=lq, kv_len=lk, mask=mask, causal=causal)
    return tiles, visited_entries(_tiled.tile_states(shape.spec(), mask, bq, bk), lq, lk, bq, bk, causal)


@pytest.mark.parametrize("spec", PATTERNS + COMBOS)
def test_closed_form_equals_block_map(spec):
    mask = masks.from_string(spec)
    checked = 0
    for lq, lk in LENGTHS:
        if spec.startswith("documents") and (lq, lk) != (77, 77):
            continue  # documents need the lengths to add up to the sequence
        for bq, bk in TILES:
            for causal in (False, True):
                shape = costs.AttentionShape(heads=1, q_len=lq, kv_len=lk, mask=mask, causal=causal)
                try:
                    got = count_tiles(Grid(lq, lk, bq, bk), visited._tree(shape), causal_cut=causal)
                except Unsupported:
                    continue  # a stride wider than these small tiles: the caller counts the map
                assert got == _block_map_counts(mask, lq, lk, bq, bk, causal), (spec, lq, lk, bq, bk, causal)
                checked += 1
    assert checked >= 10, f"{spec}: only {checked} cases had a closed form"


def _tile_leaves(rng) -> list[str]:
    return [
        "full", "causal", "causal_lower_right", f"sliding_window:{rng.randint(1, 30)}",
        f"sliding_window:{rng.randint(1, 30)}:causal", f"dilated_window:{rng.randint(1, 5)}:{rng.randint(1, 4)}",
        f"strided:{rng.randint(1, 6)}", f"strided:{rng.randint(1, 6)}:causal=false", f"fixed:{rng.randint(1, 6)}:1",
        f"fixed:{rng.randint(2, 6)}:2:causal=false",
        "global_tokens:" + ",".join(str(rng.randint(0, 90)) for _ in range(rng.randint(1, 5))),
    ]


def _random_spec(rng, depth: int) -> str:
    return random_composition(rng, depth, _tile_leaves, 0.3)


@pytest.mark.parametrize("seed", range(4))
def test_random_combinations_equal_block_map(seed):
    """A seeded fuzz over nested & | ~ of every pattern, lengths, tile sizes, causal or not."""
    import random

    rng = random.Random(seed)
    checked = 0
    for _ in range(60):
        spec = _random_spec(rng, 3)
        lq, lk, bq, bk, causal = random_geometry(rng, 12)
        mask = masks.from_string(spec)
        shape = costs.AttentionShape(heads=1, q_len=lq, kv_len=lk, mask=mask, causal=causal)
        try:
            want = _block_map_counts(mask, lq, lk, bq, bk, causal)
        except MaskError:  # a bare global_tokens with every index past the sequence refuses
            continue
        try:
            got = count_tiles(Grid(lq, lk, bq, bk), visited._tree(shape), causal_cut=causal)
        except Unsupported:
            continue
        assert got == want, (spec, lq, lk, bq, bk, causal)
        checked += 1
    assert checked >= 30


@pytest.mark.parametrize("spec", [None, "sliding_window:256", "sliding_window:128|global_tokens:0",
                                  "documents:3000,5000&causal", "strided:64"])
def test_cost_formulas_read_the_closed_form(spec):
    """tiled and sparse costs agree with counting their kernels' maps at a realistic size."""
    mask = masks.from_string(spec) if spec else None
    for causal in (False, True):
        shape = costs.AttentionShape(heads=2, q_len=8000, head_dim=64, mask=mask, causal=causal)
        tiles, pairs = _block_map_counts(mask or masks.full(), 8000, 8000, _sparse.BLOCK_Q, _sparse.BLOCK_K, causal)
        assert costs.sparse.visited_tiles(shape) == tiles * 2
        _, pairs = _block_map_counts(mask or masks.full(), 8000, 8000, _tiled.BLOCK_Q, _tiled.BLOCK_K, causal)
        assert costs.tiled.visited_pairs(shape) == pairs


@pytest.mark.parametrize("mask", [masks.fixed(200, 2), masks.global_tokens(list(range(0, 900, 50))),
                                  masks.strided(300), masks.bigbird(64), masks.padding([700, 1000])],
                         ids=["wide-fixed", "many-globals", "wide-stride", "bigbird", "padding"])
def test_patterns_once_without_closed_form_are_counted_exactly(mask):
    """These once fell back to the block map; now each has a counter (bigbird: streamed row by row)."""
    for causal in (False, True):
        shape = costs.AttentionShape(heads=1, batch=mask.batch_size or 1, q_len=1000, mask=mask, causal=causal)
        eff = _sparse.effective_mask(mask, causal)
        bm = _sparse.block_map(eff, 1000, 1000, shape.batch, 1, 128, 128)
        assert costs.sparse.visited_tiles(shape) == int((bm.state != 0).sum()) * shape.batch // bm.state.shape[0]


def test_a_map_too_large_to_count_is_refused_with_its_size():
    with pytest.raises(CostModelError, match="tiles of 128x128"):
        costs.estimate(costs.AttentionShape(q_len=10**9, mask=masks.bigbird(64)), "sparse")


_BIG = r"""
import resource, sys
from headlab import costs, masks
from headlab.spec import blocks
from headlab.attention.backends import tiled
def no_maps(*a, **k):
    raise AssertionError("a block map was built")
blocks.BlockMap.from_mask = staticmethod(no_maps)
tiled.tile_states = no_maps
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
cap = vm + 100 * 2**20  # 100 MiB more address space than already mapped: any n^2 buffer fails
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
N = 10**12
specs = sys.argv[1:]
for spec in specs:
    for causal in (False, True):
        mask = None if spec == "none" else masks.from_string(spec)
        table = costs.estimate_all(costs.AttentionShape(q_len=N, causal=causal, mask=mask))
        assert table["sparse"].forward_flops > 0 and table["tiled"].forward_flops > 0, spec
print("ok", len(specs))
"""


def test_a_trillion_tokens_without_maps_under_a_memory_cap():
    specs = ["none", "causal", "causal_lower_right", "sliding_window:256", "sliding_window:256:causal",
             "dilated_window:128:2", "strided:64", "global_tokens:0,1,5000",
             f"documents:{6 * 10**11},{4 * 10**11}", "sliding_window:128|global_tokens:0,1",
             f"documents:{5 * 10**11},{5 * 10**11}&causal", "~sliding_window:4", "fixed:64:4",
             "fixed:100:3:causal=false", "padding:700000000000", "dilated_window:64:1000", "strided:1000000",
             "fixed:1000000:64", "dilated_window:64:1000|global_tokens:0"]
    res = subprocess.run([sys.executable, "-c", _BIG, *specs], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == f"ok {len(specs)}"


def test_trillion_causal_counts_are_the_triangle():
    n_b = 10**12 // 128  # 128 divides 10^12: every tile is whole
    shape = costs.AttentionShape(heads=1, q_len=10**12, causal=True)
    assert visited.tiles(shape, 128, 128) == n_b * (n_b + 1) // 2
    # tiled: 256 x 512 tiles cut at the diagonal hold exactly the n (n + 1) / 2 visible pairs plus the
    # masked part of the diagonal tiles left of the cut
    n = 10**12
    pairs = visited.pairs(shape, 256, 512)
    assert n * (n + 1) // 2 <= pairs <= n * (n + 1) // 2 + n * 256


def test_long_index_lists_are_read_from_the_pattern_when_it_shows_them():
    """A name shows at most 8 entries; a public ``lengths`` / ``indices`` attribute gives the rest."""
    lengths = [7, 30, 1, 12, 5, 60, 9, 9, 40, 27]
    docs = masks.documents(lengths)
    shape = costs.AttentionShape(heads=1, q_len=200, mask=docs, causal=True)
    assert "..." in docs.name
    if getattr(docs, "lengths", None) is None:
        with pytest.raises(Unsupported):
            visited._tree(shape)
        docs.lengths = list(lengths)  # what a pattern object with public attributes carries
    got = count_tiles(Grid(200, 200, 16, 16), visited._tree(shape), causal_cut=True)
    assert got == _block_map_counts(docs, 200, 200, 16, 16, True)
    glob = masks.global_tokens(list(range(3, 200, 17)))
    if getattr(glob, "indices", None) is None:
        glob.indices = list(range(3, 200, 17))
    shape = costs.AttentionShape(heads=1, q_len=200, mask=glob)
    assert count_tiles(Grid(200, 200, 16, 8), visited._tree(shape)) == _block_map_counts(glob, 200, 200, 16, 8, False)
