"""local: a head whose weight stays within the last ``w`` keys (DuoAttention's streaming heads).

Score: on the natural text (:mod:`.shared`), the mean over rows of the mass on keys ``0 <= i - j < w``
(encoders ``|i - j| < w``; ``w`` the atlas's ``window``), meaned over the pieces. Checked on the
log-perplexity of the text (an encoder: ``1 - cos`` of its pooled embedding).
"""

from __future__ import annotations

from headlab.interpret.atlas import scores as S
from headlab.interpret.atlas.kinds.base import Kind, register
from headlab.interpret.atlas.kinds.shared import TEXT_LOSS, text_grid


def score(run):
    window, causal = run.sizes["window"], run.adapter.causal
    return text_grid(run, lambda q, k, ca, st: S.window_mass(q, k, ca, window, causal=causal, full=st.lse)[0].mean(-1))


KIND = register(
    Kind(
        name="local",
        role="local",
        threshold=0.7,  # mean weight within the last w keys
        score=score,
        reads="text",
        task=TEXT_LOSS,
        letter="L",
        colour="#2ca02c",
        definition="mean weight within the last w keys (16 by default), on real text (Xiao et al. 2024, DuoAttention)",
    )
)
