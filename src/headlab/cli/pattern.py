"""``headlab pattern``: draw a sparse attention pattern and its density."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import typer
from rich.text import Text

from headlab.spec import masks
from headlab.attention.backends.sparse.plan import pattern_density
from headlab.cli.app import app, check_at_least, check_output_file, console, print_json
from headlab.errors import ConfigError

# largest sequence drawn densely (a PNG of n x n pixels; the terminal is downsampled anyway)
MAX_DENSE = 8192
_SHADES = " ░▒▓█"

# CLI option of each constructor parameter (the constructors and their names: headlab.masks)
_OPTION = {"window": "--window", "dilation": "--dilation", "stride": "--stride", "summary": "--summary",
           "block": "--block", "window_blocks": "--window-blocks", "global_blocks": "--global",
           "indices": "--global (token indices, e.g. 0,5)", "random_blocks": "--random", "seed": "--seed",
           "lengths": "--lengths (e.g. 10,12,10)"}


def spec(name: str, *, window=None, dilation=2, stride=None, summary=1, block=None, window_blocks=3,
         global_=None, random=2, seed=0, causal=False, lengths=None) -> str:
    """The :func:`headlab.masks.from_string` spec the command's options stand for.

    ``name`` is a pattern of :func:`headlab.masks.pattern`, whose constructor receives the options
    named like its parameters (``name:param=value:...``), or already a spec. ``strided`` and
    ``fixed`` are causal as in the paper (``--causal`` changes nothing); their two-sided forms are
    reachable as specs, e.g. ``strided:8:causal=false``. For the other patterns ``--causal`` is
    their ``causal`` parameter or ANDs ``causal``. ``global_`` is the raw ``--global`` text: a
    block count for ``bigbird``, token indices for ``global_tokens``; it and ``lengths`` go into the
    spec as written, so anything but digits, commas and signs is refused here, naming the option.

        >>> spec("sliding_window", window=4, causal=True)
        'sliding_window:window=4:causal=true'
        >>> spec("documents", lengths="3,5", causal=True)
        'documents:lengths=3,5&causal'
    """
    if any(c in name for c in ":&|~()"):
        return f"({name})&causal" if causal else name
    params = inspect.signature(masks.pattern(name)).parameters  # unknown names: a ConfigError listing the known
    for option, text in (("--global", global_), ("--lengths", lengths)):
        if text is not None and not re.fullmatch(r"[0-9,\s-]*", text):  # no letters, no spec operators
            raise ConfigError(f"{option} must be comma-separated integers such as 0,5,9; got {text!r}")
    given = {"window": window, "dilation": dilation, "stride": stride, "summary": summary, "block": block,
             "window_blocks": window_blocks, "global_blocks": global_, "indices": global_,
             "random_blocks": random, "seed": seed, "lengths": lengths}
    args = []
    for p in params.values():
        if p.name == "causal":
            continue
        value = given.get(p.name)
        if value is None:
            if p.default is inspect.Parameter.empty:
                raise ConfigError(f"pattern {name!r} needs {_OPTION.get(p.name, '--' + p.name)}")
            continue
        args.append(f"{p.name}={value}")
    if causal and "causal" in params:
        args.append("causal=true")
    term = ":".join([name, *args])
    return f"{term}&causal" if causal and "causal" not in params else term


def build(name: str, **options) -> masks.MaskFn:
    """The mask for ``name`` and the command's options: :func:`headlab.masks.from_string` of :func:`spec`."""
    return masks.from_string(spec(name, **options))


def _render(dense, max_cells: int) -> Text:
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


@app.command("pattern")
def pattern(
    name: str = typer.Argument(..., help=f"one of {', '.join(masks.pattern_names())}, or a mask spec like "
                                         "'sliding_window:4&causal'"),
    seq_len: int = typer.Option(32, "--seq-len", "-n", help="positions (queries = keys)"),
    window: int = typer.Option(None, "--window", help="sliding/dilated window: keys on each side"),
    dilation: int = typer.Option(2, "--dilation", help="dilated_window: step between keys"),
    stride: int = typer.Option(None, "--stride", help="strided / fixed: the stride l"),
    summary: int = typer.Option(1, "--summary", help="fixed: summary cells per block c"),
    block: int = typer.Option(None, "--block", help="bigbird: positions per block"),
    window_blocks: int = typer.Option(3, "--window-blocks", help="bigbird: odd window width in blocks"),
    global_: str = typer.Option(None, "--global",
                               help="bigbird: global blocks (default 2); global_tokens: indices 0,5"),
    random: int = typer.Option(2, "--random", help="bigbird: random blocks per block row"),
    seed: int = typer.Option(0, "--seed", help="bigbird: seed of the random blocks"),
    causal: bool = typer.Option(False, "--causal", help="keep only keys at or before the query"),
    lengths: str = typer.Option(None, "--lengths", help="documents: lengths such as 10,12,10"),
    tile: int = typer.Option(None, "--tile", help="tile size for the tile density (default: min(kernel tile, n/8))"),
    head: int = typer.Option(0, "--head", help="head to draw for per-head patterns"),
    png: str = typer.Option(None, "--png", help="write the pattern as a PNG picture to this file"),
    width: int = typer.Option(64, "--width", help="largest drawing in the terminal, in characters"),
    as_json: bool = typer.Option(False, "--json", help="print the densities as JSON, no drawing"),
) -> None:
    """Draw an attention pattern (rows: queries, columns: keys) with its density.

    Example: headlab pattern sliding_window --window 4 --seq-len 32
    """
    if seq_len <= 0 or seq_len > MAX_DENSE:
        raise ConfigError(f"--seq-len must be in 1..{MAX_DENSE} to draw a pattern, got {seq_len}")
    check_at_least("--width", width, 1, what=" character")
    if png:  # before the work: a folder, a path under a file, an unwritable place (an existing PNG is replaced)
        check_output_file(Path(png), "--png", force=True)
    m = build(name, window=window, dilation=dilation, stride=stride, summary=summary, block=block,
              window_blocks=window_blocks, global_=global_, random=random, seed=seed, causal=causal,
              lengths=lengths)
    heads = m.num_heads or 1
    if not 0 <= head < heads:
        raise ConfigError(f"--head must be in 0..{heads - 1} for this pattern, got {head}")
    d = pattern_density(m, seq_len, tile=tile, head=head)
    info = {"pattern": m.name, "seq_len": seq_len, "visible_pairs": d.visible_pairs, "pair_density": d.pair_density,
            "tile": d.tile, "visited_tiles": d.visited_tiles, "tiles": d.tiles, "tile_density": d.tile_density,
            "full_tile_share": d.full_tile_share, "rows_without_keys": d.rows_without_keys}
    if as_json:
        print_json(info)
    else:
        console.print(_render(d.visible, width), end="")
        console.print(f"{m.name}: {seq_len}x{seq_len}, {d.pair_density:.1%} of pairs visible; "
                      f"{d.visited_tiles}/{d.tiles} tiles of {d.tile}x{d.tile} visited ({d.tile_density:.1%}, "
                      f"{d.full_tile_share:.1%} full)" + (f"; {d.rows_without_keys} rows see no key (output zeros)"
                                                          if d.rows_without_keys else ""), highlight=False)
    if png:
        _save_png(d.visible, png, f"{m.name}  n={seq_len}  pairs {d.pair_density:.1%}  tiles {d.tile_density:.1%}")
        if not as_json:
            console.print(f"wrote {png}", highlight=False)


def _save_png(dense, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5), dpi=120)
    ax.imshow(dense.numpy(), cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise ConfigError(f"cannot write the PNG to {path!r}: {e.strerror}; choose a writable path") from None
    finally:
        plt.close(fig)
