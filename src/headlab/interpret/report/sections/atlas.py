"""The atlas section: each head's roles from the head atlas (:func:`headlab.atlas`), scores only.

The roles are properties of the model, not of the analysed text, so the section runs the atlas's own
small inputs (two sequences of 16 random tokens repeated; one 64-token piece of the shipped passage for
sink and local when the model has a tokenizer) and no causal check and no OV copying score, to keep the
report quick; ``headlab atlas`` runs the checks and writes every score. It reads nothing from the recording
and writes no file; the page gets a table of the heads carrying each role.
"""

from __future__ import annotations

import html

from headlab.interpret.report.sections.base import Job, PagePart, Section, register

KINDS = ("previous_token", "duplicate_token", "induction", "sink", "local")


@register
class AtlasSection(Section):
    name = "atlas"

    def active(self, job: Job) -> bool:
        return hasattr(job.adapter.model, "get_input_embeddings") or hasattr(job.adapter.model, "tok_emb")

    def compute(self, job: Job, cache, results):
        from headlab.interpret.atlas import atlas

        kinds = list(KINDS) if job.loaded.tokenizer is not None else list(KINDS[:3])
        return atlas(job.loaded, kinds=kinds, checks=False, copying=False, evidence=False, half=16, n_repeated=2,
                     n_texts=1, max_tokens=64)

    def page(self, job: Job, result, results) -> PagePart:
        from headlab.interpret.atlas.kinds import ROLE

        rows = []
        for kind, s in result.summary().items():
            heads = ", ".join(s["heads"][:12]) + (f" (+{s['count'] - 12})" if s["count"] > 12 else "")
            rows.append(f"<tr><td>{html.escape(ROLE[kind])}</td><td>&ge; {s['threshold']}</td><td>{s['count']} "
                        f"({100 * s['share']:.1f}%)</td><td>{html.escape(heads or '-')}</td></tr>")
        caption = ("Roles from the head atlas (scores only, on the atlas's own random and natural inputs, not this "
                   "text): previous-token, duplicate-token and induction on random tokens repeated once (Olsson et "
                   "al. 2022), sink and local mass on real text. `headlab atlas` adds retrieval heads and the causal "
                   "checks and writes every score.")
        part = (f'<section id="atlas-section"><h2>Head roles (atlas)</h2><p class="hint">{html.escape(caption)}</p>'
                f"<table><tr><th>role</th><th>threshold</th><th>heads</th><th>which (layer.head)</th></tr>"
                f"{''.join(rows)}</table></section>")
        return PagePart(html=part)


__all__ = ["AtlasSection"]
