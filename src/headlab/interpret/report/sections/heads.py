"""The heads section: the per-head table and the maps the page and the layer PNGs draw.

Full mode: every map is in the recording (``pattern`` of every layer); the table's row statistics
come from the maps (:func:`~headlab.interpret.heads.labels.row_stats_from_maps`). Streaming mode
(longer than ``max_full_tokens``): the table comes from the map-free statistics the recording holds
(``stats``, run inside each layer's forward with its own mask and scale), and only the chosen heads'
maps are computed, one ``(n, n)`` map at a time, from the recorded q and k.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from headlab.attention.core import attention_weights
from headlab.errors import MemoryBudgetError
from headlab.interpret.heads.labels import (
    HeadRecord,
    head_records,
    row_stats_from_attention_stats,
    row_stats_from_maps,
)
from headlab.interpret.report.sections.base import Job, Section, register
from headlab.interpret.report.selection import (
    MAX_EMBEDDED_BYTES,
    default_drawn_heads,
    embeddable,
    interesting_heads,
)

STREAM_STATS = ("entropy", "max_weight", "argmax", "mean_distance", "key_mass", "received")


@dataclass
class HeadsTable:
    """The table and the maps: what the heads section found."""

    records: list[HeadRecord]  # one per (layer, head), layer-major
    maps: dict[tuple[int, int], np.ndarray]  # drawn heads' (n, n) weights
    drawn: list[tuple[int, int]]
    embedded: list[tuple[int, int]]  # the drawn heads whose maps the page carries
    notes: list[str] = field(default_factory=list)  # the long-input notices (analyze puts them first)
    pngs: list = field(default_factory=list)  # the layer pictures written


def memory_hint(e: MemoryBudgetError, n: int) -> MemoryBudgetError:
    """The full mode's refusal: a backend hint does not help (every map is drawn); say how to stream."""
    head = str(e).split("; use backend=")[0]
    return MemoryBudgetError(
        f"{head}; the report's full mode holds every {n} x {n} map: raise HEADLAB_MEMORY_LIMIT, or use "
        f"streaming statistics with `headlab analyze TEXT --max-full-tokens {max(1, n - 1)}` "
        "(max_full_tokens=), which hold no full map",
        estimate_bytes=e.estimate_bytes,
        available_bytes=e.available_bytes,
        alternative=None,
    )


def _map_of(job: Job, cache, layer: int, h: int) -> np.ndarray:
    """Head ``h`` of ``layer``'s ``(n, n)`` map from the recorded q and k, with the layer's own mask, scale and
    score modification (soft-capping, ALiBi)."""
    adapter = job.adapter
    group = max(1, adapter.layer_heads[layer] // adapter.layer_kv_heads[layer])  # per layer: pruned layers differ
    q = cache[adapter.site_name(layer, "q")][:, h : h + 1]  # (1, 1, L, d)
    k = cache[adapter.site_name(layer, "k")][:, h // group : h // group + 1]  # (1, 1, L, d)
    call = cache.call_args[layer]
    mask = call["mask"]
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] > 1:
        mask = mask[:, h : h + 1]  # (B, 1, Lq, Lk): a per-head mask, this head's slice
    mod = call.get("score_mod")
    extra = {"score_mod": (lambda s, b, hh, qi, kv, mod=mod, h=h: mod(s, b, hh + h, qi, kv))} if mod else {}
    w = attention_weights(q, k, mask=mask, causal=call["causal"], scale=call["scale"], **extra)  # (1, 1, L, L)
    return w[0, 0].float().cpu().numpy()


@register
class HeadsSection(Section):
    name = "heads"

    def sites(self, job: Job) -> list[str]:
        kinds = ("pattern",) if job.mode == "full" else ("stats", "q", "k")
        return [g for k in kinds for g in job.adapter.sites(k)]

    def stats(self, job: Job) -> set[str]:
        return set() if job.mode == "full" else set(STREAM_STATS)

    def compute(self, job: Job, cache, results) -> HeadsTable:
        n = job.n
        if job.mode == "full":
            layer_maps = [m[0].float().cpu().numpy() for m in cache.layer("pattern")]  # (H, L, L) per layer
            rows = [row_stats_from_maps(m, sink_positions=job.sinks, causal=job.causal) for m in layer_maps]
            maps = {(i, h): m[h] for i, m in enumerate(layer_maps) for h in range(m.shape[0])}
            notes = []
        else:
            rows = [
                row_stats_from_attention_stats(st, sink_positions=job.sinks, causal=job.causal)
                for st in cache.layer("stats")
            ]
            maps = None
        records = head_records(rows, job.tokens, separator_positions=job.separators, thresholds=job.thresholds)
        if maps is None:
            drawn = job.chosen or default_drawn_heads(records)
            maps = {(layer, h): _map_of(job, cache, layer, h) for layer, h in drawn}
            notes = self._stream_notes(job, list(maps))
        if job.annotations:
            records = [replace(r, notes=_notes(job.annotations.get((r.layer, r.head)))) for r in records]
        drawn = list(maps)
        embedded = drawn if job.mode == "full" else drawn[: embeddable(n, len(drawn))]
        return HeadsTable(records, maps, drawn, embedded, notes)

    @staticmethod
    def _stream_notes(job: Job, drawn) -> list[str]:
        n = job.n
        notes = [
            f"long input: {n} tokens > {job.max_full_tokens}, so the table comes from streaming statistics "
            f"(no {n} x {n} map held) and maps are drawn only for heads "
            f"{', '.join(f'{a}.{b}' for a, b in drawn)}"
            + (
                ""
                if job.chosen
                else " (chosen automatically: "
                "the heads whose rows most often point at a fixed offset; pick others with --heads)"
            )
        ]
        fits = embeddable(n, len(drawn))
        if fits < len(drawn):
            one = 2 * n * n / 2**20
            notes.append(
                f"at {n} tokens one map takes {one:.0f} MiB in the page, which holds at most "
                f"{MAX_EMBEDDED_BYTES >> 20} MiB of maps: "
                + (
                    f"it embeds {', '.join(f'{a}.{b}' for a, b in drawn[:fits])}; "
                    if fits
                    else "it embeds none (the table and the statistics are all there); "
                )
                + "every drawn head is in the layer PNGs"
            )
        return notes

    def write(self, job: Job, result: HeadsTable, results) -> list[str]:
        """One PNG per layer with drawn heads: a grid of their maps with token labels."""
        from headlab.interpret.report.figures import LayerGrid

        titles = {(r.layer, r.head): ", ".join(r.labels) for r in result.records}
        grid = None
        n_layers = job.adapter.n_layers
        for layer in range(n_layers):
            hs = [h for (l_, h) in sorted(result.drawn) if l_ == layer]
            if not hs:
                continue
            job.say(f"drawing layer {layer + 1}/{n_layers}")
            if grid is None or grid.n_maps != len(hs):  # the same tokens on every layer: reuse the figure
                grid = LayerGrid(job.tokens, len(hs))
            maps_l = np.stack([result.maps[(layer, h)] for h in hs])  # (len(hs), L, L)
            result.pngs.append(
                grid.draw(
                    maps_l,
                    job.out / f"layer_{layer:02d}.png",
                    layer=layer,
                    head_ids=hs,
                    titles=[titles[(layer, h)] for h in hs],
                )
            )
        return []


def initial_head(result: HeadsTable, chosen) -> tuple[int, int]:
    """The head the page shows first: the first one asked for, else the clearest example of a label."""
    shown = set(result.embedded)
    picks = [*(chosen or []), *((r.layer, r.head) for _, r in interesting_heads(result.records))]
    return next((d for d in picks if d in shown), min(result.embedded or result.drawn))


def _notes(value) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


__all__ = ["HeadsSection", "HeadsTable", "STREAM_STATS", "initial_head", "memory_hint"]
