"""Every built-in pattern is predicted exactly, at any length, without building a block map.

The independent computation is the kernels' own block maps: the sparse kernel's
(``sparse.block_map`` of ``mask & causal``, non-empty tiles summed over batch and heads) and the
tiled kernel's (``tiled.tile_states``, combined over batch and heads, weighted by the tile areas
with the causal cut). Small lengths that break the tiling (77 x 100, 1 x 5) and awkward tiles
(3 x 5, 7 x 7, 1 x 9) make strides, dilations and cells wider than a tile, narrower than a tile,
and straddling tile edges. At 10^12 tokens every pattern answers in under a second and 100 MiB
with the block-map builders patched to fail.
"""

from __future__ import annotations

import random
import time
import tracemalloc

import pytest
import torch

from headlab import costs, masks
from headlab.spec import blocks
from headlab.attention.backends import sparse as _sparse
from headlab.attention.backends import tiled as _tiled
from headlab.costs.tiles import streamed_count, visited
from headlab.costs.tiles.diagonal_count import count_diagonal
from headlab.costs.tiles.document_count import count_documents
from headlab.costs.tiles.fixed_count import count_fixed
from headlab.costs.tiles.floor_sums import floor_sums
from headlab.costs.tiles.grid import Grid, Unsupported
from headlab.costs.tiles.interval_count import count_tiles
from headlab.costs.tiles.layout_count import count_layout
from headlab.errors import CountTooLargeError, MaskError

from cases import random_composition, random_geometry, visited_entries


def kernel_counts(mask, lq, lk, bq, bk, causal, batch=1, heads=1):
    """(tiles the sparse kernel computes over batch x heads, entries the tiled kernel visits per slice)."""
    eff = _sparse.effective_mask(mask, causal) or masks.full()
    tiles = _sparse.visited_tiles(_sparse.block_map(eff, lq, lk, batch, heads, bq, bk), batch, heads)
    shape = costs.AttentionShape(heads=heads, batch=batch, q_len=lq, kv_len=lk, mask=mask, causal=causal)
    return tiles, visited_entries(_tiled.tile_states(shape.spec(), mask, bq, bk), lq, lk, bq, bk, causal)


def predicted(mask, lq, lk, bq, bk, causal, batch=1, heads=1):
    shape = costs.AttentionShape(heads=heads, batch=batch, q_len=lq, kv_len=lk, mask=mask, causal=causal)
    return visited.tiles(shape, bq, bk), visited.pairs(shape, bq, bk)


# -- the case table: every built-in pattern, with sizes that are wide and narrow against the tiles --
_LAYOUT = torch.Generator().manual_seed(3)


def _layout(lq, lk, cell, heads=None, p=0.4):
    nq, nk = -(-lq // cell[0]), -(-lk // cell[1])
    shape = (nq, nk) if heads is None else (heads, nq, nk)
    return masks.block_layout(torch.rand(shape, generator=_LAYOUT) < p, cell)


CASES = {  # name: (mask for (q_len, kv_len), batch, heads, lengths it applies to)
    "full": (lambda lq, lk: masks.full(), 1, 1, None),
    "causal": (lambda lq, lk: masks.causal(), 1, 1, None),
    "causal_lower_right": (lambda lq, lk: masks.causal_lower_right(), 1, 1, None),
    "padding": (lambda lq, lk: masks.padding([lk // 3, lk, 0]), 3, 1, None),
    "sliding_window": (lambda lq, lk: masks.sliding_window(6), 1, 1, None),
    "sliding_window causal": (lambda lq, lk: masks.sliding_window(4, causal=True), 1, 1, None),
    "dilated_window narrow": (lambda lq, lk: masks.dilated_window(3, 2), 1, 1, None),
    "dilated_window wide": (lambda lq, lk: masks.dilated_window(3, 17), 1, 1, None),
    "dilated_window wide causal": (lambda lq, lk: masks.dilated_window(2, 23, causal=True), 1, 1, None),
    "strided narrow": (lambda lq, lk: masks.strided(4), 1, 1, None),
    "strided wide": (lambda lq, lk: masks.strided(13), 1, 1, None),
    "strided wide non-causal": (lambda lq, lk: masks.strided(19, causal=False), 1, 1, None),
    "fixed narrow": (lambda lq, lk: masks.fixed(3, 1), 1, 1, None),
    "fixed wide": (lambda lq, lk: masks.fixed(11, 2), 1, 1, None),
    "fixed wide non-causal": (lambda lq, lk: masks.fixed(14, 3, causal=False), 1, 1, None),
    "global_tokens": (lambda lq, lk: masks.global_tokens([0, 5, 6, 7, 30]), 1, 1, None),
    "global_tokens many": (lambda lq, lk: masks.global_tokens(list(range(1, 200, 9))), 1, 1, None),
    "documents": (lambda lq, lk: masks.documents([10, 7, 30, 30]), 1, 1, [(77, 77)]),
    "documents many": (lambda lq, lk: masks.documents([5, 1, 9, 2, 12, 3, 8, 4, 11, 6, 16]), 1, 1, [(77, 77)]),
    "bigbird": (lambda lq, lk: masks.bigbird(4, 3, 2, 3, seed=1), 1, 1, None),
    "bigbird wide blocks": (lambda lq, lk: masks.bigbird(13, 1, 1, 2), 1, 1, None),
    "block_layout": (lambda lq, lk: _layout(lq, lk, (4, 6)), 1, 1, None),
    "block_layout per head": (lambda lq, lk: _layout(lq, lk, (11, 3), heads=3), 1, 3, None),
    # compositions
    "sliding | global": (lambda lq, lk: masks.sliding_window(3) | masks.global_tokens([0, 9]), 1, 1, None),
    "dilated wide | global": (lambda lq, lk: masks.dilated_window(2, 15) | masks.global_tokens([0, 1, 40]), 1, 1, None),
    "~strided wide": (lambda lq, lk: ~masks.strided(12), 1, 1, None),
    "strided wide & ~strided wide": (lambda lq, lk: masks.strided(12) & ~masks.strided(9), 1, 1, None),
    "strided wide & documents": (lambda lq, lk: masks.strided(11) & masks.documents([30, 47]), 1, 1, [(77, 77)]),
    "~(dilated wide & causal) | global": (lambda lq, lk: ~(masks.dilated_window(1, 20) & masks.causal())
                                          | masks.global_tokens([3]), 1, 1, None),
    "padding & sliding": (lambda lq, lk: masks.padding([lk // 2, lk]) & masks.sliding_window(5), 2, 2, None),
    "~padding | strided wide": (lambda lq, lk: ~masks.padding([lk // 2]) | masks.strided(11), 1, 1, None),
    "block_layout & strided wide": (lambda lq, lk: _layout(lq, lk, (5, 5)) & masks.strided(14), 1, 1, None),
    "fixed wide | sliding": (lambda lq, lk: masks.fixed(12, 2) | masks.sliding_window(4), 1, 1, None),
    "bigbird & ~causal": (lambda lq, lk: masks.bigbird(5, 3, 1, 2) & ~masks.causal(), 1, 1, None),
    "documents & causal_lower_right": (lambda lq, lk: masks.documents([40, 37]) & masks.causal_lower_right(),
                                       1, 1, [(77, 77)]),
}
LENGTHS = [(77, 77), (64, 64), (100, 77), (77, 100), (1, 5), (5, 1)]
TILES = [(4, 4), (8, 16), (16, 8), (3, 5), (7, 7), (1, 9)]


@pytest.mark.parametrize("name", list(CASES))
def test_every_builtin_pattern_is_counted_exactly(name):
    make, batch, heads, lengths = CASES[name]
    checked = 0
    for lq, lk in lengths or LENGTHS:
        mask = make(lq, lk)
        for bq, bk in TILES:
            for causal in (False, True):
                want = kernel_counts(mask, lq, lk, bq, bk, causal, batch, heads)
                assert predicted(mask, lq, lk, bq, bk, causal, batch, heads) == want, (name, lq, lk, bq, bk, causal)
                checked += 1
    assert checked >= 12


# counted on the block map row by row: BigBird's random blocks, and a `fixed` stride wider than the
# key tiles inside a composition (alone, or with causal, it has its own counter)
STREAMED = {"bigbird", "bigbird wide blocks", "bigbird & ~causal", "fixed wide | sliding"}


@pytest.mark.parametrize("name", [n for n in CASES if n not in STREAMED])
def test_deterministic_patterns_never_walk_a_block_map(name, monkeypatch):
    """Every other case has a closed form here: its block map is never streamed."""

    def no(*a, **k):
        raise AssertionError("the block map was streamed")

    monkeypatch.setattr(streamed_count, "tiles", no)
    monkeypatch.setattr(streamed_count, "pairs", no)
    make, batch, heads, lengths = CASES[name]
    lq, lk = (lengths or [(100, 77)])[0]
    predicted(make(lq, lk), lq, lk, 7, 7, True, batch, heads)
    predicted(make(lq, lk), lq, lk, 3, 5, False, batch, heads)


def _offset_leaves(rng) -> list[str]:
    return [f"strided:{rng.randint(1, 30)}", f"strided:{rng.randint(1, 30)}:causal=false",
              f"dilated_window:{rng.randint(1, 4)}:{rng.randint(1, 25)}",
              f"dilated_window:{rng.randint(1, 4)}:{rng.randint(1, 25)}:causal",
              f"sliding_window:{rng.randint(1, 20)}", "causal", "causal_lower_right", "full",
              "global_tokens:" + ",".join(str(rng.randint(0, 90)) for _ in range(rng.randint(1, 3))),
              f"padding:{rng.randint(0, 90)}"]


def _offset_spec(rng, depth):
    return random_composition(rng, depth, _offset_leaves, 0.35)


@pytest.mark.parametrize("seed", range(3))
def test_diagonal_counter_on_random_compositions(seed):
    """The diagonal counter alone (any stride, any dilation, with global tokens and padding) against
    the block maps, on a seeded fuzz of nested & | ~."""
    rng = random.Random(seed)
    checked = 0
    for _ in range(60):
        spec = _offset_spec(rng, 3)
        lq, lk, bq, bk, causal = random_geometry(rng, 10)
        mask = masks.from_string(spec)
        try:
            want = kernel_counts(mask, lq, lk, bq, bk, causal)
        except MaskError:  # a bare global_tokens with every index past the sequence refuses
            continue
        tree = visited._tree(costs.AttentionShape(heads=1, q_len=lq, kv_len=lk, mask=mask, causal=causal))
        assert count_diagonal(Grid(lq, lk, bq, bk), tree, causal_cut=causal) == want, (spec, lq, lk, bq, bk, causal)
        checked += 1
    assert checked >= 50


def test_fixed_counter_over_many_periods():
    """Long enough for the rows of a period to be extrapolated (the counter checks a third period too)."""
    rng = random.Random(5)
    for s, c, non_causal in ((13, 1, False), (9, 4, True), (40, 40, False), (6, 1, True)):
        mask = masks.fixed(s, c, causal=not non_causal)
        for _ in range(4):
            lq = rng.randint(600, 1500)
            lk = lq if rng.random() < 0.5 else rng.randint(600, 1500)
            bq, bk = rng.randint(2, 7), rng.randint(2, 7)
            causal = rng.random() < 0.5
            tree = visited._tree(costs.AttentionShape(heads=1, q_len=lq, kv_len=lk, mask=mask, causal=causal))
            got = count_fixed(Grid(lq, lk, bq, bk), tree, causal_cut=causal)
            assert got == kernel_counts(mask, lq, lk, bq, bk, causal), (s, c, non_causal, lq, lk, bq, bk, causal)


def test_layout_counter_cells_wider_and_narrower_than_tiles():
    rng = random.Random(2)
    for _ in range(40):
        lq, lk = rng.randint(1, 150), rng.randint(1, 150)
        bq, bk, cell = rng.randint(1, 12), rng.randint(1, 12), (rng.randint(1, 20), rng.randint(1, 20))
        mask = _layout(lq, lk, cell, p=rng.random())
        causal = rng.random() < 0.5
        tree = visited._tree(costs.AttentionShape(heads=1, q_len=lq, kv_len=lk, mask=mask, causal=causal))
        assert count_layout(Grid(lq, lk, bq, bk), tree, causal_cut=causal) == kernel_counts(mask, lq, lk, bq, bk, causal)


def test_documents_counter_with_bands():
    """Documents alone, with causal, with (causal) sliding windows: against the maps, and at long
    lengths against the interval counter (exact Python integers past int64)."""
    rng = random.Random(4)
    for _ in range(120):
        n = rng.randint(1, 160)
        cut = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 12)))) if n > 1 else []
        mask = masks.documents([b - a for a, b in zip([0, *cut], [*cut, n])])
        extra = rng.choice([None, masks.causal(), masks.sliding_window(rng.randint(1, 30)),
                            masks.sliding_window(rng.randint(1, 30), causal=True), masks.causal_lower_right()])
        mask = mask if extra is None else mask & extra
        bq, bk, causal = rng.randint(1, 12), rng.randint(1, 12), rng.random() < 0.5
        tree = visited._tree(costs.AttentionShape(heads=1, q_len=n, mask=mask, causal=causal))
        assert count_documents(Grid(n, n, bq, bk), tree, causal_cut=causal) == kernel_counts(mask, n, n, bq, bk, causal)
    for n, k in ((10**12, 2), (10**12, 300), (10**9 + 7, 50)):
        cut = sorted(rng.sample(range(1, n), k - 1))
        mask = masks.documents([b - a for a, b in zip([0, *cut], [*cut, n])]) & masks.sliding_window(1000)
        for causal in (False, True):
            tree = visited._tree(costs.AttentionShape(heads=1, q_len=n, mask=mask, causal=causal))
            for bq, bk in ((128, 128), (256, 512)):
                g = Grid(n, n, bq, bk)
                assert count_documents(g, tree, causal_cut=causal) == count_tiles(g, tree, causal_cut=causal)


def test_floor_sums_against_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        n, a, b, m = rng.randint(0, 40), rng.randint(0, 60), rng.randint(-300, 300), rng.randint(1, 70)
        want = (sum((a * k + b) // m for k in range(n)), sum(k * ((a * k + b) // m) for k in range(n)))
        assert floor_sums(n, a, b, m) == want


@pytest.mark.parametrize("name", ["bigbird", "block_layout", "fixed wide", "documents many", "padding & sliding",
                                  "strided wide & ~strided wide"])
def test_block_rows_equal_the_block_map(name):
    """The row-range classifiers (what the streaming counter walks) give the map's own rows."""
    make, batch, heads, lengths = CASES[name]
    lq, lk = (lengths or [(100, 77)])[0]
    mask = make(lq, lk)
    for bq, bk in ((3, 5), (8, 8)):
        full = blocks.block_map(mask, lq, lk, bq, bk, batch=batch, heads=heads).state
        n = full.shape[2]
        for i0 in range(0, n, 4):
            part = blocks.block_rows(mask, lq, lk, bq, bk, i0, min(n, i0 + 4), batch=batch, heads=heads)
            assert torch.equal(part.expand(*full.shape[:2], -1, -1), full[:, :, i0:i0 + 4])


def test_bigbird_rows_drawn_in_pieces_equal_the_whole_layout():
    """More than 256 block rows: the generator state is restored from a checkpoint, not replayed."""
    m = masks.bigbird(1, window_blocks=1, global_blocks=0, random_blocks=2, seed=4)
    whole = m.cell_rows(700, 700, "cpu")
    for c0, c1 in ((600, 700), (0, 10), (255, 520), (513, 514)):
        assert torch.equal(m.cell_rows(700, 700, "cpu", c0, c1), whole[:, c0:c1])


# -- 10^12 tokens -----------------------------------------------------------------------------------

N = 10**12
AT_1E12 = {  # every built-in pattern, with arguments in tokens
    "full": masks.full(), "causal": masks.causal(), "causal_lower_right": masks.causal_lower_right(),
    "padding": masks.padding([7 * 10**11]), "sliding_window": masks.sliding_window(256),
    "dilated_window": masks.dilated_window(128, 2), "dilated_window wide": masks.dilated_window(64, 1000),
    "strided": masks.strided(64), "strided sqrt(n)": masks.strided(10**6),
    "fixed": masks.fixed(64, 4), "fixed sqrt(n)": masks.fixed(10**6, 64),
    "global_tokens": masks.global_tokens([0, 1, 5000]), "documents": masks.documents([6 * 10**11, 4 * 10**11]),
    "block_layout": masks.block_layout(torch.rand(1000, 1000, generator=_LAYOUT) < 0.1, 10**9),
    "longformer": masks.dilated_window(64, 1000) | masks.global_tokens(list(range(64))),
    "documents & strided": masks.documents([5 * 10**11] * 2) & masks.strided(10**6),
    "10^4 documents & causal": masks.documents([10**8] * 10**4) & masks.causal(),
    "~sliding_window": ~masks.sliding_window(4),
}


@pytest.mark.parametrize("name", list(AT_1E12))
def test_a_trillion_tokens_in_a_second_and_100_mib_without_maps(name, monkeypatch):
    def no_maps(*a, **k):
        raise AssertionError("a block map was built")

    monkeypatch.setattr(blocks.BlockMap, "from_mask", staticmethod(no_maps))
    monkeypatch.setattr(streamed_count, "block_rows", no_maps)
    monkeypatch.setattr(_tiled, "tile_states", no_maps)
    for causal in (False, True):
        shape = costs.AttentionShape(q_len=N, mask=AT_1E12[name], causal=causal)
        t = time.process_time()  # CPU time of this process: other jobs on the machine do not count
        table = costs.estimate_all(shape)
        elapsed = time.process_time() - t
        tracemalloc.start()  # apart: tracing slows Python several times
        costs.estimate_all(shape)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert table["sparse"].forward_flops > 0 and table["tiled"].forward_flops > 0
        assert peak < 100 * 2**20, f"{name}: {peak / 2**20:.1f} MiB"
        assert elapsed < 1.0, f"{name}: {elapsed:.2f} s"


def test_bigbird_at_a_trillion_tokens_is_refused_with_its_range(monkeypatch):
    monkeypatch.setattr(blocks.BlockMap, "from_mask", staticmethod(lambda *a, **k: 1 / 0))
    shape = costs.AttentionShape(q_len=N, mask=masks.bigbird(64), causal=True)
    tracemalloc.start()
    with pytest.raises(CountTooLargeError, match="random blocks are drawn per block row") as e:
        costs.estimate(shape, "sparse")
    assert tracemalloc.get_traced_memory()[1] < 100 * 2**20
    tracemalloc.stop()
    err = e.value
    assert err.work > err.budget and 0 < err.max_len < N
    low, high = err.bounds
    assert 0 < low <= high < (N // 128) ** 2
    assert "use a length up to about" in str(err)
    # what the message promises: below that length the count is exact (and the maps may be built again)
    monkeypatch.undo()
    lq = err.max_len // 2
    m = masks.bigbird(64)
    got = costs.sparse.visited_tiles(costs.AttentionShape(heads=1, q_len=lq, mask=m, causal=True))
    eff = _sparse.effective_mask(m, True)
    assert got == int((_sparse.block_map(eff, lq, lq, 1, 1, 128, 128).state != 0).sum())


def test_bigbird_bounds_hold_where_the_count_is_exact():
    m = masks.bigbird(16, window_blocks=3, global_blocks=1, random_blocks=2)
    for lq, causal in ((3000, False), (2500, True)):
        shape = costs.AttentionShape(heads=1, q_len=lq, mask=m, causal=causal)
        low, high, rand = streamed_count._bigbird_bounds(shape, 128, 128)
        assert low <= visited.tiles(shape, 128, 128) <= high + rand


def test_the_cost_model_refuses_what_the_mask_refuses():
    """Lengths that do not fit the pattern are the mask's error, said before any counting."""
    with pytest.raises(MaskError, match="must add up"):
        costs.estimate(costs.AttentionShape(q_len=N, mask=masks.documents([10**11])), "sparse")
    lay = masks.block_layout(torch.ones(4, 4, dtype=torch.bool), 10)
    with pytest.raises(MaskError, match="build the layout for this length"):
        costs.estimate(costs.AttentionShape(q_len=N, mask=lay), "tiled")
    per_head = masks.block_layout(torch.ones(3, 4, 4, dtype=torch.bool), 10)
    with pytest.raises(MaskError, match="built for 3 heads"):
        costs.estimate(costs.AttentionShape(heads=6, q_len=40, mask=per_head), "sparse")


def test_unsupported_is_what_the_counters_raise():
    with pytest.raises(Unsupported):
        count_fixed(Grid(10, 10, 2, 2), visited._tree(costs.AttentionShape(q_len=10, mask=masks.causal())))
