"""The report's single self-contained HTML page: pick a layer and head, see its heatmap and its norm
map, hover a token to see where it attends and what attends to it, and the rollout of the input.

No network and no libraries: the page is headlab's one shell (:func:`headlab.interpret.shell.page`,
its stylesheet inline) around the body ``assets/report_body.html``, with the script and the data
written inline; each report section's own HTML (:mod:`headlab.interpret.report.sections`) goes in
the body's sections slot. Maps travel as base64 little-endian ``uint16`` (weight =
value / 65535, so a readout is exact to 1.5e-5), one per drawn ``"layer.head"``. A head's norm map
is its weight map times the value norms ``||f_h(x_j)||`` (``flow.value_norms``, one per key), drawn
with each row divided by its sum; the rollout map travels like a weight map.

Opening the page with ``#selftest`` after its address makes it check itself (every drawn head
paints its heatmap; a synthetic hover reaches both token strips and the heatmap) and write
``<pre id="selftest-result" data-status="pass|fail">`` into the document; script errors are
written into the document too (``<pre class="selftest-error">``). ``tests/test_browser.py`` reads
them through headless Chromium's ``--dump-dom``.
"""

from __future__ import annotations

import base64
import html
import re
from importlib import resources
from typing import Mapping, Sequence

import numpy as np

from headlab.errors import ShapeError
from headlab.interpret import shell
from headlab.interpret.heads.labels import HeadRecord
from headlab.interpret.heads.naming import per_layer_counts

_TAGS = {"previous-token": "P", "next-token": "N", "self": "S", "separator-sink": "K", "broad": "B"}


def encode_map(P) -> str:
    """One ``(q_len, k_len)`` map as base64 of little-endian ``uint16`` (round(weight * 65535)).

    >>> import numpy as np
    >>> s = encode_map(np.array([[1.0, 0.0], [0.25, 0.75]]))
    >>> np.frombuffer(base64.b64decode(s), dtype="<u2").tolist()
    [65535, 0, 16384, 49151]
    """
    a = np.asarray(P.detach().cpu() if hasattr(P, "detach") else P, dtype=np.float64)
    q = np.rint(np.clip(a, 0.0, 1.0) * 65535).astype("<u2")
    return base64.b64encode(q.tobytes()).decode("ascii")


def _asset(name: str) -> str:
    return resources.files("headlab.interpret.report").joinpath("assets", name).read_text(encoding="utf-8")


def _picker(records: Sequence[HeadRecord], counts: Sequence[int], drawn: set[tuple[int, int]]) -> str:
    by = {(r.layer, r.head): r for r in records}
    out = ['<table class="picker"><thead><tr><th></th>']
    out += [f"<th>H{h}</th>" for h in range(max(counts))]
    out.append("</tr></thead><tbody>")
    for layer, n_l in enumerate(counts):
        out.append(f"<tr><th>L{layer}</th>")
        for h in range(n_l):
            r = by[(layer, h)]
            tags = "".join(_TAGS[label] for label in r.labels)
            tip = f"layer {layer}, head {h}: " + ("; ".join(r.evidence) if r.evidence else "no pattern label")
            if r.notes:
                tip += "; " + "; ".join(r.notes)
            cls = "" if (layer, h) in drawn else ' class="undrawn"'
            out.append(
                f'<td><button type="button"{cls} data-layer="{layer}" data-head="{h}" '
                f'title="{html.escape(tip)}">{layer}.{h}<span class="tags">{tags or "&nbsp;"}</span>'
                f"</button></td>"
            )
        out += ['<td class="removed" title="this layer has fewer heads (a pruned model)">&ndash;</td>'] * (
            max(counts) - n_l
        )
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _table(records: Sequence[HeadRecord], first_label: str) -> str:
    cols = [
        ("layer", "layer", 0),
        ("head", "head", 0),
        ("entropy", "entropy", 3),
        ("norm_entropy", "norm. entropy", 2),
        ("mean_distance", "mean distance", 2),
        ("confidence", "confidence", 3),
        ("mass_first", first_label, 3),
        ("mass_sep", "mass [SEP]", 3),
        ("top_token", "most attended", None),
        ("top_content_token", "most attended word", None),
        ("labels", "pattern labels", None),
    ]
    if any(r.notes for r in records):
        cols.append(("notes", "other studies", None))
    out = ['<table class="stats"><thead><tr>']
    # text columns are left-aligned, headers included, so each header sits over its values
    out += [f"<th{'' if digits is not None else ' class=text'}>{html.escape(title)}</th>" for _, title, digits in cols]
    out.append("</tr></thead><tbody>")
    for r in records:
        out.append(f'<tr data-layer="{r.layer}" data-head="{r.head}" title="{html.escape("; ".join(r.evidence))}">')
        for name, _, digits in cols:
            v = getattr(r, name)
            if name in ("labels", "notes"):
                out.append(f'<td class="text">{html.escape(("; " if name == "notes" else ", ").join(v))}</td>')
            elif digits is None:
                out.append(f'<td class="text">{html.escape("" if v is None else str(v))}</td>')
            else:
                out.append(f"<td>{'&ndash;' if v is None else (v if digits == 0 else f'{v:.{digits}f}')}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def check_flow(flow: Mapping | None, n: int) -> dict | None:
    """The flow part of the page data, its lengths checked against the ``n`` tokens."""
    if flow is None:
        return None
    rows = [*flow.get("value_norms", {}).values(), *flow.get("rollout", {}).get("rows", {}).values()]
    for r in rows:
        if len(r) != n:
            raise ShapeError(
                f"a norm or rollout row of the page has {len(r)} values for {n} tokens; pass one per token."
            )
    return dict(flow)


def render_html(
    *,
    title: str,
    tokens: Sequence[str],
    records: Sequence[HeadRecord],
    maps: Mapping[tuple[int, int], object],
    n_layers: int,
    n_heads: int | Sequence[int],
    summary_lines: Sequence[str] = (),
    banner: str | None = None,
    first_label: str = "mass [CLS]",
    undrawn_note: str = "",
    initial: tuple[int, int] | None = None,
    flow: Mapping | None = None,
    sections: Sequence[str] = (),
    extra_data: Mapping[str, object] | None = None,
) -> str:
    """The whole page as one string.

    Args:
        title: page heading.
        tokens: the ``n`` token strings.
        records: one :class:`HeadRecord` per (layer, head), every layer and head.
        maps: ``{(layer, head): (n, n) weights}`` for the heads to draw (all of them for short
            inputs; the chosen ones for long inputs).
        n_layers, n_heads: the model's shape; ``n_heads`` is one count for every layer or a count per
            layer (a pruned model), and the records number their sum.
        summary_lines: plain-text lines under the heading (model, text, ...).
        banner: a highlighted note (the long-input notice), or ``None``.
        first_label: the name of the first-token column ("mass [CLS]" or "mass first token").
        undrawn_note: shown when a head without a map is picked.
        initial: the (layer, head) shown first (default: the first drawn head).
        flow: the norm maps and the rollout view, as
            :meth:`~headlab.interpret.report.sections.flow.FlowView.page_data` gives them:
            ``{"value_norms": {"layer.head": [||f_h(x_j)|| for j]}, "rollout": {"layer", "note",
            "rows": {"pos": [n floats]}, "map": base64 (full mode)}}``; ``None`` leaves both out.
        sections: the report sections' own HTML (trusted: built from escaped text), in order, between the
            rollout and the table (:mod:`headlab.interpret.report.sections`).
        extra_data: more page data, ``{section name: JSON-able}``, beside the maps (for sections' scripts).

    Example:
        >>> import numpy as np
        >>> from headlab.interpret.heads.labels import row_stats_from_maps, head_records
        >>> P = np.full((1, 2, 2), 0.5)
        >>> recs = head_records([row_stats_from_maps(P, sink_positions=[0])], ["a", "b"], separator_positions=None)
        >>> page = render_html(title="t", tokens=["a", "b"], records=recs, maps={(0, 0): P[0]}, n_layers=1, n_heads=1)
        >>> page.startswith("<!DOCTYPE html>") and "http" not in page.split("<body>")[1]
        True
    """
    n = len(tokens)
    counts = per_layer_counts(n_layers, n_heads)
    if len(records) != sum(counts):
        raise ShapeError(f"{len(records)} head records for {n_layers} layers x {n_heads} heads; pass one per head.")
    if not maps and not undrawn_note:
        raise ShapeError("no maps to draw: pass at least one (layer, head) map, or an undrawn_note saying why none is.")
    encoded = {}
    for (layer, head), P in maps.items():
        shape = tuple(getattr(P, "shape", ()))
        if shape != (n, n):
            raise ShapeError(f"map of layer {layer} head {head} has shape {shape}; expected ({n}, {n}) for {n} tokens.")
        encoded[f"{layer}.{head}"] = encode_map(P)
    first = initial if initial in maps or not maps else min(maps)
    first = first or (records[0].layer, records[0].head)
    data = {
        "tokens": list(tokens),
        "records": [r.as_dict() for r in records],
        "maps": encoded,
        "n_layers": n_layers,
        "n_heads": max(counts),
        "layer_heads": counts,
        "initial": list(first),
        "first_label": first_label,
        "undrawn_note": undrawn_note,
        "flow": check_flow(flow, n),
    }
    data.update(extra_data or {})
    drawn = set(maps)
    parts = {
        "__HEADLAB_PICKER__": _picker(records, counts, drawn),
        "__HEADLAB_LAYER_OPTIONS__": "".join(f'<option value="{i}">{i}</option>' for i in range(n_layers)),
        "__HEADLAB_HEAD_OPTIONS__": "".join(f'<option value="{i}">{i}</option>' for i in range(max(counts))),
        "__HEADLAB_TABLE__": _table(records, first_label),
        "__HEADLAB_SECTIONS__": "".join(sections),
    }
    # One pass over the template, so text that happens to contain a marker is never re-substituted.
    body = re.sub("|".join(re.escape(k) for k in parts), lambda m: parts[m.group(0)], _asset("report_body.html"))
    return shell.page(
        title=title,
        body=body,
        summary_lines=summary_lines,
        banner=banner,
        data=data,
        script=_asset("report.js"),
        generator="headlab analyze",
    )


__all__ = ["check_flow", "encode_map", "per_layer_counts", "render_html"]
