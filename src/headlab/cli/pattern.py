"""``headlab pattern``: draw a sparse attention pattern and its density."""

from __future__ import annotations

import inspect

import typer
from rich.text import Text

from headlab.attention import masks
from headlab.attention.backends import sparse as _sparse
from headlab.attention.blocks import block_map
from headlab.attention.states import EMPTY, FULL
from headlab.cli.app import app, console, print_json
from headlab.errors import ConfigError

# largest sequence drawn densely (a PNG of n x n pixels; the terminal is downsampled anyway)
MAX_DENSE = 8192
_SHADES = " ░▒▓█"


def _ints(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers such as 0,5,9; got {text!r}") from None


# CLI option of each constructor parameter (the constructors and their names: headlab.masks)
_OPTION = {"window": "--window", "dilation": "--dilation", "stride": "--stride", "summary": "--summary",
           "block": "--block", "window_blocks": "--window-blocks", "global_blocks": "--global",
           "indices": "--global (token indices, e.g. 0,5)", "random_blocks": "--random", "seed": "--seed",
           "lengths": "--lengths (e.g. 10,12,10)"}


def build(name: str, *, window=None, dilation=2, stride=None, summary=1, block=None, window_blocks=3,
          global_=None, random=2, seed=0, causal=False, lengths=None) -> masks.MaskFn:
    """The mask for ``name`` from the command's options, or a :func:`headlab.masks.from_string` spec.

    The constructor comes from :func:`headlab.masks.pattern` and receives the options named like
    its parameters. ``strided`` and ``fixed`` are causal as in the paper (``--causal`` changes
    nothing); their two-sided forms are reachable as specs, e.g. ``strided:8:causal=false``. For
    the other patterns ``--causal`` is their ``causal`` parameter or ANDs :func:`headlab.masks.causal`.
    ``global_`` is the raw ``--global`` text: a block count for ``bigbird``, token indices for
    ``global_tokens``.
    """
    if any(c in name for c in ":&|~()"):
        m = masks.from_string(name)
        return m & masks.causal() if causal else m
    ctor = masks.pattern(name)  # unknown names: a ConfigError listing the known ones
    g = _ints(global_, "--global")
    if g is not None and "global_blocks" in inspect.signature(ctor).parameters and len(g) != 1:
        raise ConfigError(f"{name} --global is a number of global blocks, got {global_!r}")
    given = {"window": window, "dilation": dilation, "stride": stride, "summary": summary, "block": block,
             "window_blocks": window_blocks, "global_blocks": None if g is None else g[0], "indices": g,
             "random_blocks": random, "seed": seed, "lengths": _ints(lengths, "--lengths")}
    kwargs = {}
    params = inspect.signature(ctor).parameters
    for p in params.values():
        if p.name == "causal":
            continue
        value = given.get(p.name)
        if value is None:
            if p.default is inspect.Parameter.empty:
                raise ConfigError(f"pattern {name!r} needs {_OPTION.get(p.name, '--' + p.name)}")
            continue
        kwargs[p.name] = value
    if "causal" in params:
        return ctor(**kwargs, causal=causal or params["causal"].default)
    m = ctor(**kwargs)
    return m & masks.causal() if causal else m


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
    m = build(name, window=window, dilation=dilation, stride=stride, summary=summary, block=block,
              window_blocks=window_blocks, global_=global_, random=random, seed=seed, causal=causal,
              lengths=lengths)
    heads = m.num_heads or 1
    if not 0 <= head < heads:
        raise ConfigError(f"--head must be in 0..{heads - 1} for this pattern, got {head}")
    dense = m.dense(heads=heads, q_len=seq_len)
    dense = dense[0, min(head, dense.shape[1] - 1)]  # (seq_len, seq_len) of the chosen head
    tile = tile or max(1, min(_sparse.BLOCK_Q, seq_len // 8))
    bm = block_map(m, seq_len, seq_len, tile, tile, heads=heads)
    state = bm.state[0, min(head, bm.state.shape[1] - 1)]
    pairs = float(dense.float().mean())
    tiles = float((state != EMPTY).float().mean())
    full_t = float((state == FULL).float().mean())
    info = {"pattern": m.name, "seq_len": seq_len, "visible_pairs": int(dense.sum()), "pair_density": pairs,
            "tile": tile, "visited_tiles": int((state != EMPTY).sum()), "tiles": int(state.numel()),
            "tile_density": tiles, "full_tile_share": full_t,
            "rows_without_keys": int((~dense.any(-1)).sum())}
    if as_json:
        print_json(info)
    else:
        console.print(_render(dense, width), end="")
        console.print(f"{m.name}: {seq_len}x{seq_len}, {pairs:.1%} of pairs visible; "
                      f"{info['visited_tiles']}/{info['tiles']} tiles of {tile}x{tile} visited ({tiles:.1%}, "
                      f"{full_t:.1%} full)" + (f"; {info['rows_without_keys']} rows see no key (output zeros)"
                                                 if info["rows_without_keys"] else ""), highlight=False)
    if png:
        _save_png(dense, png, f"{m.name}  n={seq_len}  pairs {pairs:.1%}  tiles {tiles:.1%}")
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
