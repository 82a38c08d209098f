"""Patching: the causal instruments of circuit work, built on capture's edits.

- :func:`patch` (exact activation patching): the clean run with one head's activation (z, q, k, v or a
  pattern row; per position on request) taken from the corrupted run; configurations stacked in the batch.
- :func:`path_patch` (Wang et al. 2022): a sender head's corrupted output along its path into receiver
  heads' q, k or v (or into the logits), every other head frozen at clean.
- :func:`attribution_patch` (Nanda 2023; Kramar et al. 2024): the first-order estimate of every patch
  in one forward and one backward; :func:`compare` gives its rank correlation with exact patching.
- :func:`direct_logit_attribution` and :func:`logit_lens` (:mod:`.readout`): each head's output read
  through the final norm and the unembedding; the residual stream read layer by layer.

Every effect is normalised the same way: ``(m_patched - m_clean) / (m_corrupted - m_clean)`` (0 = no
change, 1 = the whole clean/corrupted gap), see :mod:`.result`. Metrics are functions of the logits,
one value per example (:mod:`.metrics`: :func:`logit_diff`).
"""

from headlab.interpret.patching.attribution import attribution_patch
from headlab.interpret.patching.exact import patch
from headlab.interpret.patching.metrics import logit_diff, logit_of
from headlab.interpret.patching.path import path_patch
from headlab.interpret.patching.prompts import prompt_pair
from headlab.interpret.patching.readout import DLAResult, LensResult, direct_logit_attribution, logit_lens
from headlab.interpret.patching.result import CONVENTION, PatchResult, compare

__all__ = [
    "CONVENTION",
    "DLAResult",
    "LensResult",
    "PatchResult",
    "attribution_patch",
    "compare",
    "direct_logit_attribution",
    "logit_diff",
    "logit_lens",
    "logit_of",
    "patch",
    "path_patch",
    "prompt_pair",
]
