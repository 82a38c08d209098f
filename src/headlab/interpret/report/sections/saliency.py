"""The saliency section: a strip for the model's own output, and each head's tau with IG.

Only where the model has a head to explain (a sequence classifier, or a decoder's next token) and
the input is short enough for every map (the report's "full" mode). The strip (one panel per method,
tokens shaded, and the agreement matrix) goes into ``report.html`` itself; ``saliency.png`` (tokens x
methods, :func:`~headlab.interpret.saliency.figures.explanation_png`), ``saliency.html`` (the
``headlab explain`` page) and ``saliency.json`` are written beside it, and each head's evidence gains
its Kendall tau with |integrated gradients| over the non-special tokens. Its gradients need their
own passes (:func:`headlab.explain`); it reads nothing from the recording.
"""

from __future__ import annotations

import dataclasses
import html
import warnings

from headlab.errors import ModelError
from headlab.interpret.report.sections.base import Job, PagePart, Section, register


@register
class SaliencySection(Section):
    name = "saliency"

    def active(self, job: Job) -> bool:
        return job.mode == "full" and job.adapter.has_task_head

    def compute(self, job: Job, cache, results):
        """The explanation (or None for a model without a head); adds each head's tau to the heads' evidence."""
        from headlab.interpret.saliency.annotations import head_annotations
        from headlab.interpret.saliency.explanation import explanation  # inside analyze's unit: not a run of its own

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ex = explanation(job.loaded, job.text, backend=job.backend or "auto", attention_layers="all")
        except ModelError:  # no classification or LM head: nothing to explain
            return None
        table = results["heads"]
        notes = head_annotations(ex)
        table.records = [
            dataclasses.replace(r, evidence=(*r.evidence, notes[(r.layer, r.head)]))
            if (r.layer, r.head) in notes
            else r
            for r in table.records
        ]
        return ex

    def write(self, job: Job, ex, results) -> list[str]:
        from headlab.interpret.saliency.figures import explanation_png
        from headlab.interpret.saliency.html import write_explanation

        if ex is None:
            return []
        paths = write_explanation(ex, job.out)
        for kind in ("html", "png", "json"):
            paths[kind].rename(job.out / f"saliency.{kind}")
        explanation_png(ex, job.out / "saliency.png")
        return []

    def page(self, job: Job, ex, results) -> PagePart:
        from headlab.interpret.saliency.html import explanation_fragment

        if ex is None:
            return PagePart()
        what = f"class {ex.target_label or ex.target}" if ex.kind == "classifier" else "the next token"
        gap = "" if ex.completeness_gap is None else f"; IG completeness gap {100 * ex.completeness_gap:.3f}%"
        caption = (
            f"Explaining {what} (logit {ex.y:.4g}){gap}. Red: supports the output, blue: against; each panel "
            "scaled by its largest |score|; grey: special tokens, left out of the rankings (Jain and Wallace "
            "2019; Sundararajan et al. 2017). The same page alone: saliency.html."
        )
        strip = (
            f'<section id="saliency-section"><h2>Saliency of the model\'s output</h2>'
            f'<p class="hint">{html.escape(caption)}</p>{explanation_fragment(ex)}</section>'
        )
        return PagePart(
            html=strip,
            notes=[
                f"saliency of {what}: the strip below the maps, saliency.html and saliency.png (attention vs gradient, "
                "IG, leave-one-out); each head's evidence ends with its Kendall tau with |IG|"
            ],
        )


__all__ = ["SaliencySection"]
