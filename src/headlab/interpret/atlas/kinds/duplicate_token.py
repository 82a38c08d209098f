"""duplicate_token: a head that attends to the earlier copy of the current token (Olsson et al. 2022; Wang et al. 2022).

Score: on ``[prefix] x_1..x_T x_1..x_T`` (random tokens repeated once, :mod:`.shared`), the mean over the
second copy's rows ``i`` of ``A[i, i - T]``. Checked on the loss on the repeated half.
"""

from __future__ import annotations

import torch

from headlab.interpret.atlas import scores as S
from headlab.interpret.atlas.kinds.base import Kind, register
from headlab.interpret.atlas.kinds.shared import REPEATED_LOSS, repeated_grid


def score(run):
    half = run.sizes["half"]
    rows = torch.arange(run.start + half, run.start + 2 * half)  # the second copy
    return repeated_grid(run, lambda q, k, ca, lse: S.offset_mass(q, k, ca, half, lse)[:, :, rows].mean(-1))


KIND = register(
    Kind(
        name="duplicate_token",
        role="duplicate-token",
        threshold=0.3,  # mean weight on the earlier copy of the token
        score=score,
        reads="repeated",
        task=REPEATED_LOSS,
        letter="D",
        colour="#9467bd",
        definition="mean weight on the token's earlier copy, A[i, i-T], on the second copy of random tokens repeated "
        "once (Olsson et al. 2022)",
    )
)
