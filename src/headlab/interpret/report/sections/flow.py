"""The flow section of ``headlab analyze``: each drawn head's norm map beside its weight map, and a rollout view.

:func:`flow_view` computes what the page shows (always, when the model's adapter gives its per-head
``W_V`` and ``W_O``), from the one recording the report makes (the attention inputs of every layer,
beside the maps or the map-free q, k and lse the heads section asked for):

- per drawn head, the value norms ``||f_h(x_j)||`` ``(n,)`` (:func:`~headlab.interpret.flow.norms.value_norms`).
  A head's norm map (Kobayashi et al. 2020) is ``||alpha_ij f_h(x_j)|| = alpha_ij ||f_h(x_j)||``, so the
  page multiplies the weight map it already holds by these n numbers: no second n x n map travels;
- the rollout through the last layer (Abnar and Zuidema 2020; :func:`~headlab.interpret.flow.rollout.rollout`):
  the full ``(n, n)`` map in full mode; past the full-map length (streaming mode) only the rows of the
  first and the last token, computed top-down without any n x n map, and the page says so.

:func:`write_flow_files` (``analyze --flow``) writes the same beside the page: ``norms_layer_00.png`` ...
(each drawn head's norm map, rows divided by their sums to read on the weight maps' 0..1 scale),
``rollout.png`` (full mode) and ``rollout.json`` (the rows of the first and the last token).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from headlab.attention.backends import is_exact
from headlab.errors import HeadlabError
from headlab.interpret.flow.norms import value_norms
from headlab.interpret.flow.record import Recording, from_cache
from headlab.interpret.flow.rollout import rollout_one as rollout  # one stack: an encoder-decoder asks for stack=
from headlab.interpret.report.figures import LayerGrid
from headlab.interpret.report.html import check_flow, encode_map
from headlab.interpret.report.sections.base import Job, PagePart, Section, register
from headlab.results import envelope, write_json


@dataclass
class FlowView:
    """What the page's flow part shows; ``skipped`` says why there is nothing (then every field is empty)."""

    mode: str  # "full" or "streaming"
    value_norms: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # (layer, head) -> (n,)
    rollout_map: np.ndarray | None = None  # (n, n), full mode
    rollout_rows: dict[int, np.ndarray] = field(default_factory=dict)  # token position -> (n,)
    rollout_layer: int = -1
    note: str = ""  # shown in the page's rollout section
    skipped: str | None = None

    def norm_map(self, layer: int, head: int, weights) -> np.ndarray:
        """``||alpha_ij f_h(x_j)||`` ``(n, n)`` from the head's weights ``(n, n)``."""
        return np.asarray(weights, dtype=np.float64) * self.value_norms[(layer, head)][None, :]

    def page_data(self) -> dict | None:
        """The JSON the page reads (``None`` when skipped); the rollout map goes as uint16 like the weight maps."""
        if self.skipped is not None:
            return None
        num = lambda a: [float(f"{v:.7g}") for v in np.asarray(a, dtype=np.float64)]
        roll = {
            "layer": self.rollout_layer,
            "note": self.note,
            "rows": {str(p): num(r) for p, r in self.rollout_rows.items()},
        }
        if self.rollout_map is not None:
            roll["map"] = encode_map(self.rollout_map)
        return {"value_norms": {f"{l}.{h}": num(v) for (l, h), v in self.value_norms.items()}, "rollout": roll}


def flow_view(
    loaded,
    recording: Recording,
    *,
    mode: str,
    drawn: Sequence[tuple[int, int]],
    max_full_tokens: int | None = None,
    say: Callable[[str], None] | None = None,
) -> FlowView:
    """Value norms of the drawn heads and the rollout view for one input (see the module docstring), from a
    :class:`~headlab.interpret.flow.record.Recording` of every layer: its maps in full mode, its q, k and
    lse in streaming mode (no forward runs here)."""
    say = say or (lambda _m: None)
    view = FlowView(mode)
    n = recording.n
    try:
        say("norm maps (value norms of the drawn heads) and rollout")
        norms = value_norms(loaded, recording, layers=sorted({l for l, _ in drawn}))
        view.value_norms = {(l, h): norms[l][h].double().cpu().numpy() for l, h in drawn}
        if mode == "full":
            roll = rollout(loaded, recording)
            assert roll.maps is not None  # every row: the maps
            view.rollout_map = roll.maps[-1].double().cpu().numpy()
            view.rollout_rows = {p: view.rollout_map[p] for p in sorted({0, n - 1})}
            view.note = "rollout through the last layer: row i says how much of each input token reaches token i"
        else:
            roll = rollout(loaded, recording, rows=sorted({0, n - 1}))
            assert roll.row_positions is not None and roll.rows is not None  # rows asked for
            view.rollout_rows = {p: r.double().cpu().numpy() for p, r in zip(roll.row_positions, roll.rows)}
            limit = f" > {max_full_tokens}" if max_full_tokens is not None else ""
            view.note = (
                f"rollout rows only: {n} tokens{limit} is past the full-map length, so only the rows of "
                "the first and the last token are computed (top-down, without any n x n map)"
            )
        view.rollout_layer = roll.layer
    except (HeadlabError, NotImplementedError) as e:  # e.g. an adapter that does not give W_V / W_O
        return FlowView(mode, skipped=f"norm maps and rollout are left out: {e}")
    return view


@register
class FlowSection(Section):
    """Norm maps beside the weight maps, and the rollout: read from the one recording."""

    name = "flow"

    def _usable(self, job: Job) -> bool:
        return job.mode == "full" or (is_exact(job.backend) and len(job.adapter.stacks) == 1)

    def sites(self, job: Job) -> list[str]:
        return job.adapter.sites("input") if self._usable(job) else []

    def stats(self, job: Job) -> set[str]:
        return {"lse"} if job.mode != "full" and self._usable(job) else set()

    def compute(self, job: Job, cache, results) -> FlowView:
        table = results["heads"]
        if not self._usable(job):
            if not is_exact(job.backend):  # streaming: the recording comes from the approximate model
                return FlowView(
                    job.mode,
                    skipped=f"norm maps and rollout are left out: backend {job.backend!r} is "
                    "approximate, and they are defined on exact softmax attention",
                )
            return FlowView(
                job.mode,
                skipped="norm maps and rollout are left out: the map-free rollout runs within "
                "one stack, and this model has " + ", ".join(job.adapter.stacks),
            )
        try:
            rec = from_cache(
                job.adapter, cache, list(range(job.adapter.n_layers)), maps=job.mode == "full", tokens=job.tokens
            )
        except HeadlabError as e:  # e.g. layers that modify their scores, which the map-free tiles do not apply
            return FlowView(job.mode, skipped=f"norm maps and rollout are left out: {e}")
        return flow_view(
            job.loaded, rec, mode=job.mode, drawn=table.drawn, max_full_tokens=job.max_full_tokens, say=job.say
        )

    def write(self, job: Job, view: FlowView, results) -> list[str]:
        if view.skipped is not None:
            return [view.skipped]
        return write_flow_files(view, results["heads"].maps, job.tokens, job.out, say=job.say) if job.write_flow else []

    def page(self, job: Job, view: FlowView, results) -> PagePart:
        data = view.page_data()
        return PagePart(data={"flow": check_flow(data, job.n)} if data is not None else {})


def write_flow_files(
    view: FlowView,
    maps: Mapping[tuple[int, int], object],
    tokens: list[str],
    out: Path,
    *,
    say: Callable[[str], None] | None = None,
) -> list[str]:
    """``analyze --flow``: the norm maps and the rollout as PNGs and ``rollout.json`` in ``out``; returns notes."""
    say = say or (lambda _m: None)
    if view.skipped is not None:
        return [view.skipped]
    say("drawing the norm maps and the rollout")
    drawn = sorted(view.value_norms)
    grid = None
    for layer in sorted({l for l, _ in drawn}):
        hs = [h for (l_, h) in drawn if l_ == layer]
        N = np.stack([view.norm_map(layer, h, maps[(layer, h)]) for h in hs])  # (len(hs), n, n)
        N = N / np.maximum(N.sum(-1, keepdims=True), 1e-30)
        if grid is None or grid.n_maps != len(hs):
            grid = LayerGrid(tokens, len(hs))
        grid.draw(
            N,
            out / f"norms_layer_{layer:02d}.png",
            layer=layer,
            head_ids=hs,
            titles=["norm ||alpha f(x)||, rows normalised"] * len(hs),
        )
    if view.rollout_map is not None:
        LayerGrid(tokens, 1).draw(
            view.rollout_map[None],
            out / "rollout.png",
            layer=view.rollout_layer,
            titles=["rollout through the last layer"],
        )
        notes = ["norm maps (norms_layer_*.png) beside the weight maps, and the rollout (rollout.png)"]
    else:
        n = len(tokens)
        notes = [
            f"rollout: rows of the first and last token only ({n} tokens is past the full-map length; "
            "rollout.json), computed top-down without n x n maps; norm maps of the drawn heads in norms_layer_*.png"
        ]
    rows = {str(p): r.tolist() for p, r in view.rollout_rows.items()}
    write_json(
        out / "rollout.json",
        envelope("rollout", {"tokens": tokens, "rows": rows}, settings={"method": "mean", "layer": view.rollout_layer}),
        indent=None,
    )
    return notes


__all__ = ["FlowSection", "FlowView", "flow_view", "write_flow_files"]
