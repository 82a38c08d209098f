"""``pattern``: a sparse attention pattern drawn with its density, as an instrument (no model).

The computation is the sparse backend's :func:`~headlab.attention.backends.sparse.plan.pattern_density` of the
mask that :func:`build` makes from the command's options (:func:`spec`: the :func:`headlab.masks.from_string`
spec they stand for). The options and the mask are checked before any work (:meth:`Pattern.check`), ``--png``
by the runner; one pattern is one unit. The result's figures are the densities ``--json`` prints; ``--png``
gets the picture (:meth:`Pattern.write`), the terminal the drawing (its view,
:mod:`headlab.cli.views.pattern`).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from headlab.attention.backends.sparse.plan import pattern_density
from headlab.errors import ConfigError
from headlab.interpret.study.base import (
    REQUIRED,
    Context,
    Instrument,
    InstrumentResult,
    Option,
    Output,
    at_least,
    register,
)
from headlab.spec import masks

# largest sequence drawn densely (a PNG of n x n pixels; the terminal is downsampled anyway)
MAX_DENSE = 8192

# CLI option of each constructor parameter (the constructors and their names: headlab.masks)
_OPTION = {
    "window": "--window",
    "dilation": "--dilation",
    "stride": "--stride",
    "summary": "--summary",
    "block": "--block",
    "window_blocks": "--window-blocks",
    "global_blocks": "--global",
    "indices": "--global (token indices, e.g. 0,5)",
    "random_blocks": "--random",
    "seed": "--seed",
    "lengths": "--lengths (e.g. 10,12,10)",
}


def spec(
    name: str,
    *,
    window=None,
    dilation=2,
    stride=None,
    summary=1,
    block=None,
    window_blocks=3,
    global_=None,
    random=2,
    seed=0,
    causal=False,
    lengths=None,
) -> str:
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
    given = {
        "window": window,
        "dilation": dilation,
        "stride": stride,
        "summary": summary,
        "block": block,
        "window_blocks": window_blocks,
        "global_blocks": global_,
        "indices": global_,
        "random_blocks": random,
        "seed": seed,
        "lengths": lengths,
    }
    for option, keys, value in (
        ("--window", ("window",), window),
        ("--stride", ("stride",), stride),
        ("--block", ("block",), block),
        ("--lengths", ("lengths",), lengths),
        ("--global", ("global_blocks", "indices"), global_),
    ):
        if value is not None and not any(k in params for k in keys):  # an option the pattern would ignore
            takers = [
                n
                for n in masks.pattern_names()
                if any(k in inspect.signature(masks.pattern(n)).parameters for k in keys)
            ]
            raise ConfigError(
                f"{option} acts only with {', '.join(takers)}; pattern {name!r} does not read it, so drop it"
            )
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


def _check_png(value, option: Option, options: dict) -> None:
    if not str(value).lower().endswith(".png") and not Path(value).expanduser().is_dir():  # a folder: the runner says
        raise ConfigError(f"--png {value!r}: give a file ending in .png (the picture is drawn as a PNG)")


def _check_seq_len(value, option: Option, options: dict) -> None:
    if value <= 0 or value > MAX_DENSE:
        raise ConfigError(f"--seq-len must be in 1..{MAX_DENSE} to draw a pattern, got {value}")


@register
class Pattern(Instrument):
    """A sparse attention pattern (rows: queries, columns: keys) with its pair and tile density."""

    name = "pattern"
    summary = """Draw an attention pattern (rows: queries, columns: keys) with its density.

Example: headlab pattern sliding_window --window 4 --seq-len 32"""
    options = (
        Option(
            "name",
            None,
            str,
            REQUIRED,
            f"one of {', '.join(masks.pattern_names())}, or a mask spec like 'sliding_window:4&causal'",
            metavar="NAME",
        ),
        Option("seq_len", "--seq-len", int, 32, "positions (queries = keys)", short="-n", check=_check_seq_len),
        Option("window", "--window", int, None, "sliding/dilated window: keys on each side"),
        Option("dilation", "--dilation", int, 2, "dilated_window: step between keys"),
        Option("stride", "--stride", int, None, "strided / fixed: the stride l"),
        Option("summary", "--summary", int, 1, "fixed: summary cells per block c"),
        Option("block", "--block", int, None, "bigbird: positions per block"),
        Option("window_blocks", "--window-blocks", int, 3, "bigbird: odd window width in blocks"),
        Option("global_", "--global", str, None, "bigbird: global blocks (default 2); global_tokens: indices 0,5"),
        Option("random", "--random", int, 2, "bigbird: random blocks per block row"),
        Option("seed", "--seed", int, 0, "bigbird: seed of the random blocks"),
        Option("causal", "--causal", bool, False, "keep only keys at or before the query"),
        Option("lengths", "--lengths", str, None, "documents: lengths such as 10,12,10"),
        Option("tile", "--tile", int, None, "tile size for the tile density (default: min(kernel tile, n/8))"),
        Option("head", "--head", int, 0, "head to draw for per-head patterns"),
        Option(
            "png",
            "--png",
            str,
            None,
            "write the pattern as a PNG picture to this file",
            setting=False,
            check=_check_png,
        ),
        Option(
            "width",
            "--width",
            int,
            64,
            "largest drawing in the terminal, in characters",
            check=at_least(1, " character"),
            setting=False,
        ),
        Option("as_json", "--json", bool, False, "print the densities as JSON, no drawing", setting=False),
    )
    # a file; an existing PNG is replaced. (file= only tells the runner to make the PNG's folder, not the PNG)
    output = Output("png", folder=False, replace=True)
    needs_model = False

    def check(self, ctx: Context) -> None:
        """The mask the options stand for (an unknown pattern, a missing or bad parameter) and --head within it."""
        o = ctx.options
        m = build(
            o["name"],
            window=o["window"],
            dilation=o["dilation"],
            stride=o["stride"],
            summary=o["summary"],
            block=o["block"],
            window_blocks=o["window_blocks"],
            global_=o["global_"],
            random=o["random"],
            seed=o["seed"],
            causal=o["causal"],
            lengths=o["lengths"],
        )
        heads = m.num_heads or 1
        if not 0 <= o["head"] < heads:
            raise ConfigError(f"--head must be in 0..{heads - 1} for this pattern, got {o['head']}")
        ctx.state["mask"] = m

    def run_unit(self, ctx: Context, unit, recording=None):
        o = ctx.options
        return pattern_density(ctx.state["mask"], o["seq_len"], tile=o["tile"], head=o["head"])

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        d, m = values[self.name], ctx.state["mask"]
        info = {
            "pattern": m.name,
            "seq_len": d.seq_len,
            "visible_pairs": d.visible_pairs,
            "pair_density": d.pair_density,
            "tile": d.tile,
            "visited_tiles": d.visited_tiles,
            "tiles": d.tiles,
            "tile_density": d.tile_density,
            "full_tile_share": d.full_tile_share,
            "rows_without_keys": d.rows_without_keys,
        }
        return InstrumentResult(self.result_kind, settings=ctx.settings, figures=info, native=d)

    def write(self, ctx: Context, result: InstrumentResult, path: Path) -> list[Path]:  # type: ignore[override]  # the runner passes this instrument's own result
        d, f = result.native, result.figures
        _save_png(
            d.visible,
            str(path),
            f"{f['pattern']}  n={d.seq_len}  pairs {d.pair_density:.1%}  tiles {d.tile_density:.1%}",
        )
        return [path]


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


__all__ = ["MAX_DENSE", "Pattern", "build", "spec"]
