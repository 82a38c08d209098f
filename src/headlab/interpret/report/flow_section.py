"""The flow part of ``headlab analyze``: each drawn head's norm map beside its weight map, and a rollout view.

Writes into the report folder

- ``norms_layer_00.png`` ...: for the heads whose weight maps are drawn, their norm maps
  ``||alpha_ij f_h(x_j)||`` (Kobayashi et al. 2020), each row divided by its sum so that they read on
  the weight maps' 0..1 scale (full mode only: they need the maps);
- ``rollout.png`` (full mode): the rollout through the last layer (Abnar and Zuidema 2020);
- ``rollout.json``: the rollout rows of the first and the last token (streaming mode: rows only,
  computed top-down without any n x n map).

Returns the notes the report shows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from headlab.interpret.flow.norms import attention_norms
from headlab.interpret.flow.rollout import rollout
from headlab.interpret.report.figures import LayerGrid


def write_flow_section(loaded, inputs, tokens: list[str], out: Path, *, mode: str,
                       drawn: Sequence[tuple[int, int]], say: Callable[[str], None] | None = None) -> list[str]:
    """Draw the norm maps and the rollout view into ``out``; return notes for the page."""
    import json

    say = say or (lambda _m: None)
    n = len(tokens)
    notes = []
    if mode == "full":
        say("norm maps and rollout")
        res = attention_norms(loaded, inputs)
        grid = None
        for layer in sorted({l for l, _ in drawn}):
            hs = [h for (l_, h) in sorted(drawn) if l_ == layer]
            maps = res.per_head[layer][hs].float().numpy()  # (len(hs), n, n)
            maps = maps / np.maximum(maps.sum(-1, keepdims=True), 1e-30)
            if grid is None or grid.n_maps != len(hs):
                grid = LayerGrid(tokens, len(hs))
            grid.draw(maps, out / f"norms_layer_{layer:02d}.png", layer=layer, head_ids=hs,
                      titles=["norm ||alpha f(x)||, rows normalised"] * len(hs))
        roll = rollout(loaded, inputs)
        LayerGrid(tokens, 1).draw(roll.maps[-1:].numpy(), out / "rollout.png", layer=roll.layer,
                                  titles=["rollout through the last layer"])
        rows = roll.maps[-1][[0, n - 1]]
        notes.append("norm maps (norms_layer_*.png) beside the weight maps, and the rollout (rollout.png)")
    else:
        say("rollout rows (top-down, no n x n map)")
        rows = rollout(loaded, inputs, rows=[0, n - 1]).rows
        notes.append(f"rollout: rows of the first and last token only ({n} tokens is past the full-map length; "
                     "rollout.json), computed top-down without n x n maps; norm maps are not drawn")
    (out / "rollout.json").write_text(json.dumps({"tokens": tokens, "rows": {"0": rows[0].tolist(),
                                                                             str(n - 1): rows[1].tolist()}}) + "\n")
    return notes


__all__ = ["write_flow_section"]
