"""`headlab pattern` is a row: the ``pattern`` instrument's options are the command's, a bad option (or --png path)
is refused before any work, its figures are the pairs and tiles counted by hand, and Ctrl-C in the one unit
writes no picture."""

from __future__ import annotations

import json
import re

import pytest

from headlab.interpret.instruments import get, runner
from headlab.interpret.instruments import pattern as instrument
from conftest import command_params, run_cli


def test_the_command_is_the_instruments_row():
    inst = get("pattern")
    assert isinstance(inst, instrument.Pattern) and not inst.needs_model
    params = command_params("pattern")
    assert set(params) == {o.name for o in inst.options}  # no model: no --tensor-parallel
    for o in inst.options:
        p = params[o.name]
        assert (o.flag is None) == (p.param_type_name == "argument"), o.name
        assert o.flag is None or (o.flag in p.opts and (o.short is None or o.short in p.opts)), o.name
        assert o.default is ... or p.default == o.default, o.name


@pytest.fixture
def no_work(monkeypatch):
    """The density (the work) fails the test: the command must refuse before it."""
    monkeypatch.setattr(instrument, "pattern_density", lambda *a, **k: pytest.fail("the work ran"))


BAD = [
    (["causal", "--seq-len", "0"], r"--seq-len must be in 1\.\.8192 to draw a pattern, got 0"),
    (["causal", "--width", "0"], r"--width must be at least 1 character, got 0"),
    (["banana"], r"unknown mask pattern 'banana'"),
    (["sliding_window"], r"pattern 'sliding_window' needs --window"),
    (["causal", "--head", "1"], r"--head must be in 0\.\.0 for this pattern, got 1"),
    (["causal", "--png", "{tmp}"], r"--png '.*' is a folder"),
    (["causal", "--png", "{tmp}/none/p.png"], r"the folder '.*none' does not exist"),
]


@pytest.mark.parametrize("args,match", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_option_is_refused_before_the_work(args, match, tmp_path, capsys, no_work):
    code, out, err = run_cli(["pattern", *[a.format(tmp=tmp_path) for a in args]], capsys)
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1, (out, err)
    assert re.search(match, err), err


def _by_hand(n: int, window: int, tile: int) -> dict:
    """Visible pairs, visited and full tiles of a two-sided window |i - j| <= window, counted pair by pair."""
    visible = {(i, j) for i in range(n) for j in range(n) if abs(i - j) <= window}
    blocks = -(-n // tile)
    seen = [[sum((i, j) in visible for i in range(a * tile, min(n, (a + 1) * tile))
                 for j in range(b * tile, min(n, (b + 1) * tile))) for b in range(blocks)] for a in range(blocks)]
    sizes = [[min(tile, n - a * tile) * min(tile, n - b * tile) for b in range(blocks)] for a in range(blocks)]
    return {"visible_pairs": len(visible), "tiles": blocks * blocks,
            "visited_tiles": sum(c > 0 for row in seen for c in row),
            "full_tiles": sum(seen[a][b] == sizes[a][b] for a in range(blocks) for b in range(blocks))}


def test_the_figures_are_the_pairs_and_tiles_counted_by_hand(tmp_path):
    n, w, t = 21, 3, 4  # 21 is not a multiple of the tile: the last row and column of tiles are partial
    out = runner.run("pattern", {"name": "sliding_window", "window": w, "seq_len": n, "tile": t,
                                 "png": str(tmp_path / "p.png")})
    f, hand = out.result.figures, _by_hand(n, w, t)
    assert f["visible_pairs"] == hand["visible_pairs"] and f["pair_density"] == pytest.approx(hand["visible_pairs"] / n**2)
    assert f["tiles"] == hand["tiles"] and f["visited_tiles"] == hand["visited_tiles"]
    assert f["full_tile_share"] == pytest.approx(hand["full_tiles"] / hand["tiles"])
    assert f["rows_without_keys"] == 0 and out.result.kind == "pattern" and out.result.model is None
    assert out.files == [tmp_path / "p.png"] and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert out.result.settings["window"] == w and "png" not in out.result.settings  # where it goes is no setting


def test_json_prints_the_results_figures(capsys):
    code, out, _ = run_cli(["pattern", "sliding_window", "--window", "3", "-n", "21", "--tile", "4", "--json"], capsys)
    assert code == 0
    hand = _by_hand(21, 3, 4)
    js = json.loads(out)
    assert js["visible_pairs"] == hand["visible_pairs"] and js["visited_tiles"] == hand["visited_tiles"]


def test_ctrl_c_in_the_one_unit_writes_no_picture(tmp_path, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(instrument, "pattern_density", interrupted)
    code, out, err = run_cli(["pattern", "causal", "--png", tmp_path / "p.png"], capsys)
    assert code == 130 and "interrupted: kept 0 of 1 units nothing was written" in err and not out
    assert not (tmp_path / "p.png").exists()
