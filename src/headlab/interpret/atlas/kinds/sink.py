"""sink: a head that parks its weight on the first token, or on [CLS] and every [SEP] (StreamingLLM's attention sink).

Score: on the natural text (:mod:`.shared`), the mean over rows of the mass on those keys (the statistics'
``key_mass``), meaned over the pieces. Checked on the log-perplexity of the text (an encoder: ``1 - cos``
of its pooled embedding).
"""

from __future__ import annotations

from headlab.interpret.atlas.kinds.base import Kind, register
from headlab.interpret.atlas.kinds.shared import TEXT_LOSS, text_grid


def score(run):
    return text_grid(run, lambda q, k, ca, st: st.key_mass[0].sum(-1).mean(-1))  # (H,): rows' mass on the sinks


KIND = register(
    Kind(
        name="sink",
        role="sink",
        threshold=0.5,  # mean weight on the first token ([CLS] and [SEP] for encoders)
        score=score,
        reads="text",
        task=TEXT_LOSS,
        letter="S",
        colour="#7f7f7f",
        definition="mean weight on the first token ([CLS] and every [SEP] for an encoder), on real text (Xiao et al. "
        "2024, StreamingLLM)",
    )
)
