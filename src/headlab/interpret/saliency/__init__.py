"""Attention versus saliency (Jain and Wallace 2019), with faithfulness measured.

- :func:`explain` (``headlab.explain``): attention, gradient, grad x input, integrated gradients,
  leave-one-out, and the flow room's rollout, norm-based rollout, attention flow and norm map row
  (:mod:`.propagation`) for one prediction, and their agreement (:mod:`.explanation`);
- :func:`study` : the same over a labelled dataset, with Jain and Wallace's corpus tables and the
  ERASER faithfulness measures (:mod:`.study`, :mod:`.faithfulness`, :mod:`.counterfactual`).
"""

from headlab.interpret.saliency.corpus_study import StudyOptions, StudyResult, read_dataset, study
from headlab.interpret.saliency.explanation import DEFAULT_METHODS, METHODS, CompletenessWarning, Explanation, explain

__all__ = [
    "DEFAULT_METHODS",
    "METHODS",
    "CompletenessWarning",
    "Explanation",
    "StudyOptions",
    "StudyResult",
    "explain",
    "read_dataset",
    "study",
]
