"""previous_token: a head that attends one token back (Olsson et al. 2022; Voita et al. 2019).

Score: on the random tokens repeated once (:mod:`.shared`), the mean over rows ``i >= 1`` of ``A[i, i - 1]``,
from the map-free statistics (:func:`headlab.interpret.atlas.scores.offset_mass`). Checked on the loss on
the repeated half.
"""

from __future__ import annotations

from headlab.interpret.atlas import scores as S
from headlab.interpret.atlas.kinds.base import Kind, register
from headlab.interpret.atlas.kinds.shared import REPEATED_LOSS, repeated_grid


def score(run):
    stop = run.start + 2 * run.sizes["half"]  # the prefix's rows after the first, and both copies
    return repeated_grid(run, lambda q, k, ca, lse: S.offset_mass(q, k, ca, 1, lse)[:, :, 1:stop].mean(-1))


KIND = register(
    Kind(
        name="previous_token",
        role="previous-token",
        threshold=0.4,  # mean weight one step back
        score=score,
        reads="repeated",
        task=REPEATED_LOSS,
        letter="P",
        colour="#1f77b4",
        definition="mean weight one token back, A[i, i-1], on random tokens repeated once (Olsson et al. 2022)",
    )
)
