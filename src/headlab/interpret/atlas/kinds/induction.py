"""induction: a head that attends to the token after the earlier copy of the current one (Olsson et al. 2022).

Score: the rows of duplicate_token, ``A[i, i - T + 1]`` (Olsson et al.'s "prefix matching"); the OV
copying score (:func:`headlab.interpret.atlas.scores.ov_copying`) sits beside it. Checked on the loss on
the repeated half, which an induction head lets the model predict.

A kind is this much: a score on one of the atlas's inputs, a threshold, a task, a letter and a colour.
"""

from __future__ import annotations

import torch

from headlab.interpret.atlas import scores as S
from headlab.interpret.atlas.kinds.base import Kind, register
from headlab.interpret.atlas.kinds.shared import REPEATED_LOSS, repeated_grid


def score(run):
    half = run.sizes["half"]
    rows = torch.arange(run.start + half, run.start + 2 * half)  # the second copy
    return repeated_grid(run, lambda q, k, ca, lse: S.offset_mass(q, k, ca, half - 1, lse)[:, :, rows].mean(-1))


KIND = register(
    Kind(
        name="induction",
        role="induction",
        threshold=0.3,  # mean weight on the token after the earlier copy
        score=score,
        reads="repeated",
        task=REPEATED_LOSS,
        letter="I",
        colour="#d62728",
        definition="mean weight on the token after the earlier copy, A[i, i-T+1], on the second copy of random "
        "tokens repeated once (Olsson et al. 2022)",
    )
)
