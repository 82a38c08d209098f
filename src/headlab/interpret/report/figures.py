"""Pictures for the report: one PNG per layer with a grid of every head's attention map.

Matplotlib's Agg canvas, used directly (no pyplot, so no global backend is switched and nothing
needs a display). Token labels run down the left of each grid row (queries) and along the top of
each grid column (keys): every map in a row or column shares them. Past :data:`MAX_LABELLED_TOKENS`
tokens only every k-th label is written so that they stay readable.

:class:`LayerGrid` builds the figure once and redraws only the images and titles for each layer
(the token labels are the same for every layer), which halves the time of a six-layer report.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from headlab.errors import ShapeError

MAX_LABELLED_TOKENS = 60  # beyond this many tokens, label every k-th one
COLUMNS = 4  # heads per row of the grid
DPI = 110


class LayerGrid:
    """A grid of ``n_maps`` heatmaps over the same ``tokens``, drawn again for each layer.

    Args:
        tokens: the ``n`` token strings (queries and keys: self-attention).
        n_maps: maps per picture (heads of a layer, or the chosen heads).

    Example:
        >>> import numpy as np, tempfile, os
        >>> grid = LayerGrid(["a", "b", "c"], n_maps=2)
        >>> d = tempfile.mkdtemp()
        >>> [grid.draw(np.full((2, 3, 3), 1 / 3), os.path.join(d, f"l{i}.png"), layer=i).stat().st_size > 0
        ...  for i in range(2)]
        [True, True]
    """

    def __init__(self, tokens: Sequence[str], n_maps: int, *, dpi: int = DPI) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        if n_maps < 1:
            raise ShapeError(f"a grid needs at least one map, got n_maps={n_maps}")
        self.tokens, self.n_maps, self.dpi = list(tokens), n_maps, dpi
        n = len(self.tokens)
        ncols = min(COLUMNS, n_maps)
        nrows = math.ceil(n_maps / ncols)
        cell = min(8.0, max(3.2, 0.17 * n))  # inches per map: room for the token labels
        fontsize = max(4.0, min(8.0, 130 / max(n, 1)))
        ticks = np.arange(0, n, max(1, math.ceil(n / MAX_LABELLED_TOKENS)))
        labels = [self.tokens[i] for i in ticks]
        self.fig = Figure(figsize=(ncols * cell + 1.0, nrows * (cell + 0.35) + 0.6))
        FigureCanvasAgg(self.fig)
        axes = self.fig.subplots(nrows, ncols, squeeze=False)
        self.images, self.axes = [], []
        blank = np.zeros((n, n), dtype=np.float32)
        for idx in range(nrows * ncols):
            ax = axes[idx // ncols][idx % ncols]
            if idx >= n_maps:
                ax.axis("off")
                continue
            im = ax.imshow(blank, cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="equal")
            top, left = idx < ncols, idx % ncols == 0
            ax.xaxis.tick_top()
            ax.set_xticks(ticks if top else [], labels if top else [], rotation=90, fontsize=fontsize)
            ax.set_yticks(ticks if left else [], labels if left else [], fontsize=fontsize)
            ax.tick_params(length=0, pad=1)
            self.images.append(im)
            self.axes.append(ax)
        self.fig.colorbar(self.images[0], ax=axes, fraction=0.015, pad=0.01, label="weight")
        self.suptitle = self.fig.suptitle("", fontsize=12)

    def draw(
        self,
        maps,
        path: str | Path,
        *,
        layer: int,
        head_ids: Sequence[int] | None = None,
        titles: Sequence[str] | None = None,
    ) -> Path:
        """Draw ``maps`` ``(n_maps, n, n)`` (one layer) and save the PNG at ``path``.

        ``head_ids`` numbers the maps (default ``0..n_maps-1``); ``titles`` adds a line under each
        head's number (its pattern labels, say).
        """
        P = np.asarray(maps.detach().cpu() if hasattr(maps, "detach") else maps, dtype=np.float32)
        n = len(self.tokens)
        if P.shape != (self.n_maps, n, n):
            raise ShapeError(
                f"maps must be ({self.n_maps}, {n}, {n}) for {self.n_maps} maps over {n} tokens; got shape {P.shape}."
            )
        head_ids = list(head_ids) if head_ids is not None else list(range(self.n_maps))
        for idx, (im, ax) in enumerate(zip(self.images, self.axes)):
            im.set_data(P[idx])
            title = f"head {head_ids[idx]}"
            if titles is not None and titles[idx]:
                title += f"\n{titles[idx]}"
            ax.set_title(title, fontsize=9, pad=4)
        self.suptitle.set_text(f"layer {layer}: attention weights (rows: query token, columns: key token)")
        path = Path(path)
        self.fig.savefig(path, dpi=self.dpi)
        return path


def layer_grid_png(
    maps,
    tokens: Sequence[str],
    path: str | Path,
    *,
    layer: int,
    head_ids: Sequence[int] | None = None,
    titles: Sequence[str] | None = None,
    dpi: int = DPI,
) -> Path:
    """Draw one layer's heads as a grid of heatmaps and save it as a PNG (a one-off :class:`LayerGrid`).

    Args:
        maps: ``(heads, q_len, k_len)`` attention weights of one layer, one sequence.
        tokens: ``k_len`` token strings (queries are the same tokens: self-attention).
        path: where to write the PNG.
        layer: the layer index, for the title.
        head_ids: the head number of each map (default ``0..heads-1``); used when only chosen heads
            are drawn.
        titles: an extra line per head (its pattern labels, say).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> import numpy as np, tempfile, os
        >>> P = np.full((2, 3, 3), 1 / 3)
        >>> out = layer_grid_png(P, ["a", "b", "c"], os.path.join(tempfile.mkdtemp(), "l0.png"), layer=0)
        >>> out.stat().st_size > 0
        True
    """
    shape = tuple(getattr(maps, "shape", ()))
    if len(shape) != 3:
        raise ShapeError(f"maps must be (heads, n, n); got shape {shape}.")
    return LayerGrid(tokens, shape[0], dpi=dpi).draw(maps, path, layer=layer, head_ids=head_ids, titles=titles)


__all__ = ["LayerGrid", "layer_grid_png"]
