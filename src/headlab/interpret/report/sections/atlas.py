"""The atlas section: each head's roles from the head atlas (:func:`headlab.atlas`), scores only.

The roles are properties of the model, not of the analysed text, so the section runs the atlas's own
small inputs (two sequences of 16 random tokens repeated; one 64-token piece of the shipped passage when
the model has a tokenizer) for the kinds that read them (``Kind.reads`` of
:data:`~headlab.interpret.atlas.kinds.KINDS`: previous_token, duplicate_token, induction; sink, local), and no
causal check and no OV copying score, to keep the report quick; ``headlab atlas`` runs the rest and the
checks and writes every score. It reads nothing from the recording and writes no file; the page gets a
table of the heads carrying each role, and says how they differ from the pattern labels of the heads above.
"""

from __future__ import annotations

import html

from headlab.interpret.report.sections.base import Job, PagePart, Section, register


def _kinds(tokenizer) -> list[str]:
    """The kinds of the atlas's two small inputs: the repeated tokens and, with a tokenizer, the shipped text."""
    from headlab.interpret.atlas.kinds import KINDS
    from headlab.interpret.atlas.kinds.shared import INPUTS

    inputs = INPUTS if tokenizer is not None else INPUTS[:1]
    return [name for name, kd in KINDS.items() if kd.reads in inputs]


@register
class AtlasSection(Section):
    name = "atlas"

    def active(self, job: Job) -> bool:
        return hasattr(job.adapter.model, "get_input_embeddings") or hasattr(job.adapter.model, "tok_emb")

    def compute(self, job: Job, cache, results):
        from headlab.interpret.atlas import atlas

        return atlas(
            job.loaded,
            kinds=_kinds(job.loaded.tokenizer),
            checks=False,
            copying=False,
            evidence=False,
            half=16,
            n_repeated=2,
            n_texts=1,
            max_tokens=64,
        )

    def page(self, job: Job, result, results) -> PagePart:
        from headlab.interpret.atlas.kinds import KINDS, ROLE
        from headlab.interpret.heads.labels import LabelThresholds

        rows = []
        for kind, s in result.summary().items():
            heads = ", ".join(s["heads"][:12]) + (f" (+{s['count'] - 12})" if s["count"] > 12 else "")
            rows.append(
                f"<tr><td>{html.escape(ROLE[kind])}</td><td>&ge; {s['threshold']}</td><td>{s['count']} "
                f"({100 * s['share']:.1f}%)</td><td>{html.escape(heads or '-')}</td></tr>"
            )
        scored = "; ".join(f"{ROLE[k]}: {KINDS[k].definition}" for k in result.kinds)
        rest = [ROLE[k] for k in KINDS if k not in result.kinds]
        caption = (
            f"Roles from the head atlas, scores only, on the atlas's own inputs (not this text): {scored}. "
            "A role is another measure than the pattern labels of the heads above (P, N, S, K, B), which are "
            "read on this text: previous-token there means at least "
            f"{LabelThresholds().positional:g} of this text's rows have their largest weight one step back; "
            "previous-token here, the mean weight one step back on random tokens at the threshold below. "
            "`headlab atlas` adds "
            + (", ".join(rest) + " and " if rest else "")
            + "the causal checks and writes every score."
        )
        part = (
            f'<section id="atlas-section"><h2>Head roles (atlas)</h2><p class="hint">{html.escape(caption)}</p>'
            f"<table><tr><th>role</th><th>threshold</th><th>heads</th><th>which (layer.head)</th></tr>"
            f"{''.join(rows)}</table></section>"
        )
        return PagePart(html=part)


__all__ = ["AtlasSection"]
