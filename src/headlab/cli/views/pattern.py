"""``headlab pattern``'s view: the pattern drawn in block characters (downsampled and shaded by density past
``--width``) with its densities; ``--json`` prints the densities instead."""

from __future__ import annotations

from rich.text import Text

from headlab.cli.views import view
from headlab.results import print_json

_SHADES = " ░▒▓█"


@view("pattern")
def show(ctx, outcome, console, err) -> None:
    o, d, f = ctx.options, outcome.result.native, outcome.result.figures
    if o["as_json"]:
        print_json(f)
        return
    console.print(draw(d.visible, o["width"]), end="")
    console.print(
        f"{f['pattern']}: {d.seq_len}x{d.seq_len}, {d.pair_density:.1%} of pairs visible; "
        f"{d.visited_tiles}/{d.tiles} tiles of {d.tile}x{d.tile} visited ({d.tile_density:.1%}, "
        f"{d.full_tile_share:.1%} full)"
        + (f"; {d.rows_without_keys} rows see no key (output zeros)" if d.rows_without_keys else ""),
        highlight=False,
    )
    if o["png"]:
        console.print(f"wrote {o['png']}", highlight=False)


def draw(dense, max_cells: int) -> Text:
    """Block characters, one per position (or per cell of positions, shaded by density)."""
    import torch

    n_q, n_k = dense.shape
    step = max(1, -(-max(n_q, n_k) // max_cells))
    t = Text()
    if step == 1:
        for row in dense.tolist():
            t.append("".join("█" if x else "·" for x in row) + "\n")
        return t
    pad_q, pad_k = (-n_q) % step, (-n_k) % step
    d = torch.nn.functional.pad(dense.float(), (0, pad_k, 0, pad_q))
    frac = d.view(d.shape[0] // step, step, d.shape[1] // step, step).mean((1, 3))
    idx = (frac * (len(_SHADES) - 1)).ceil().long()
    for row in idx.tolist():
        t.append("".join(_SHADES[i] for i in row) + "\n")
    return t


__all__ = ["draw", "show"]
