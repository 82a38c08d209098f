"""``headlab pattern``: draw a sparse attention pattern and its density."""

from __future__ import annotations

import typer
from rich.text import Text

from headlab import masks
from headlab.attention.backends import sparse as _sparse
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


def build(name: str, *, window=None, dilation=2, stride=None, summary=1, block=None, window_blocks=3,
          global_=None, random=2, seed=0, causal=False, lengths=None) -> masks.MaskFn:
    """The mask for ``name`` from the command's options, or a :func:`headlab.masks.from_string` spec.

    ``strided`` and ``fixed`` are causal as in the paper (``--causal`` changes nothing); their
    two-sided forms are reachable as specs, e.g. ``strided:8:causal=false``. For the other
    patterns ``--causal`` ANDs :func:`headlab.masks.causal`. ``global_`` is the raw ``--global``
    text: a block count for ``bigbird``, a list of token indices for ``global_tokens``.
    """

    def need(value, flag):
        if value is None:
            raise ConfigError(f"pattern {name!r} needs {flag}")
        return value

    def causal_if(m):
        return m & masks.causal() if causal else m

    if name == "sliding_window":
        return masks.sliding_window(need(window, "--window"), causal=causal)
    if name == "dilated_window":
        return masks.dilated_window(need(window, "--window"), dilation, causal=causal)
    if name == "strided":
        return masks.strided(need(stride, "--stride"))
    if name == "fixed":
        return masks.fixed(need(stride, "--stride"), summary)
    if name == "bigbird":
        g = 2 if global_ is None else _ints(global_, "--global")
        if isinstance(g, list) and len(g) != 1:
            raise ConfigError(f"bigbird --global is a number of global blocks, got {global_!r}")
        return causal_if(masks.bigbird(need(block, "--block"), window_blocks, g if isinstance(g, int) else g[0],
                                       random, seed))
    if name == "global_tokens":
        return causal_if(masks.global_tokens(need(_ints(global_, "--global"), "--global (token indices, e.g. 0,5)")))
    if name == "documents":
        return causal_if(masks.documents(need(_ints(lengths, "--lengths"), "--lengths (e.g. 10,12,10)")))
    if name in ("causal", "full", "causal_lower_right"):
        return causal_if(masks.from_string(name))
    if any(c in name for c in ":&|~()"):
        return causal_if(masks.from_string(name))
    raise ConfigError(f"unknown pattern {name!r}; known patterns: {', '.join(KNOWN)} "
                      "(or a spec such as 'sliding_window:4&causal')")


KNOWN = ["sliding_window", "dilated_window", "strided", "fixed", "global_tokens", "bigbird", "documents",
         "causal", "causal_lower_right", "full"]


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
    name: str = typer.Argument(..., help=f"one of {', '.join(KNOWN)}, or a mask spec like 'sliding_window:4&causal'"),
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
    bm = m.block_map(seq_len, seq_len, tile, tile, heads=heads)
    state = bm.state[0, min(head, bm.state.shape[1] - 1)]
    pairs = float(dense.float().mean())
    tiles = float((state != 0).float().mean())
    full_t = float((state == 2).float().mean())
    info = {"pattern": m.name, "seq_len": seq_len, "visible_pairs": int(dense.sum()), "pair_density": pairs,
            "tile": tile, "visited_tiles": int((state != 0).sum()), "tiles": int(state.numel()),
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
