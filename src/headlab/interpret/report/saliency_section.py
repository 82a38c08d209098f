"""The saliency part of the ``analyze`` report: a strip for the model's own output, and each head's tau with IG.

Only where the model has a head to explain (a sequence classifier, or a decoder's next token) and
the input is short enough for every map (the report's "full" mode). The strip (one panel per method,
tokens shaded, and the agreement matrix) goes into ``report.html`` itself; ``saliency.png`` (tokens x
methods, :func:`~headlab.interpret.saliency.figures.explanation_png`), ``saliency.html`` (the
``headlab explain`` page) and ``saliency.json`` are written beside it, and each head's evidence gains
its Kendall tau with |integrated gradients| over the non-special tokens.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

from headlab.errors import ModelError


def saliency_section(loaded, text: str, out: Path, backend: str | None,
                     records: list) -> tuple[list, list[str], tuple[str, str] | None]:
    """Returns ``(records with the tau evidence added, notes, (caption, strip HTML))``; unchanged records,
    no note and no strip without a head."""
    from headlab.interpret.saliency import explain
    from headlab.interpret.saliency.annotations import head_annotations
    from headlab.interpret.saliency.figures import explanation_png
    from headlab.interpret.saliency.html import explanation_fragment, write_explanation

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ex = explain(loaded, text, backend=backend or "auto", attention_layers="all")
    except ModelError:  # no classification or LM head: nothing to explain
        return records, [], None
    paths = write_explanation(ex, out)
    for kind in ("html", "png", "json"):
        paths[kind].rename(out / f"saliency.{kind}")
    explanation_png(ex, out / "saliency.png")
    notes = head_annotations(ex)
    updated = [dataclasses.replace(r, evidence=(*r.evidence, notes[(r.layer, r.head)]))
               if (r.layer, r.head) in notes else r for r in records]
    what = f"class {ex.target_label or ex.target}" if ex.kind == "classifier" else "the next token"
    gap = "" if ex.completeness_gap is None else f"; IG completeness gap {100 * ex.completeness_gap:.3f}%"
    caption = (f"Explaining {what} (logit {ex.y:.4g}){gap}. Red: supports the output, blue: against; each panel "
               "scaled by its largest |score|; grey: special tokens, left out of the rankings (Jain and Wallace 2019; "
               "Sundararajan et al. 2017). The same page alone: saliency.html.")
    return updated, [f"saliency of {what}: the strip below the maps, saliency.html and saliency.png (attention vs "
                     "gradient, IG, leave-one-out); each head's evidence ends with its Kendall tau with |IG|"], \
        (caption, explanation_fragment(ex))
