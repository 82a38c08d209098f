"""Rollout, attention flow and value-aware norms as explanations of one prediction.

Each gives one non-negative score per input token, read from the classification position ``c``
([CLS] = 0 for an encoder, the last real token for a decoder), by calling the flow room:

- ``rollout``: row c of the attention rollout through the last layer (Abnar and Zuidema 2020),
  ``R = A_hat_(L-1) ... A_hat_0`` with ``A_hat_l = 0.5 * mean_h(A_l) + 0.5 * I`` (rows renormalised):
  :func:`headlab.rollout` with ``rows=[c]``, computed top-down without n x n maps;
- ``norm_rollout``: the same with ``A_l`` the layer norm map of Kobayashi et al., row-normalised
  (``method="norm"``);
- ``attention_flow``: the normalised max-flow from node c at the output of the last layer to every
  input token (:func:`headlab.attention_flow`; one max-flow per input token, so the slowest of all:
  not among the default methods);
- ``attention_norm``: row c of the last layer's norm map ``||sum_h alpha^h_cj f_h(x_j)||``
  (Kobayashi et al. 2020; :func:`headlab.attention_norms` with ``rows=[c]``).

They are defined on exact softmax attention: under an approximate backend (``linear``) they run on
the exact model and :func:`exact_backend` gives the note that says so.
"""

from __future__ import annotations

from headlab.attention import backends as _backends
from headlab.interpret.flow.maxflow import flow_one as attention_flow  # one stack, as rollout
from headlab.interpret.flow.norms import attention_norms
from headlab.interpret.flow.rollout import rollout_one as rollout  # one stack: an encoder-decoder asks for stack=

FLOW_METHODS = ("rollout", "norm_rollout", "attention_flow", "attention_norm")
FLOW_GAP_NOTE = 1e-6  # a flow certificate looser than this is noted


def exact_backend(backend) -> tuple[str, str | None]:
    """``(the backend the flow methods run on, a note or None)``: ``backend`` itself when it is
    exact, else ``"auto"`` (exact) with a note naming the approximate one."""
    if backend is None or (isinstance(backend, str) and backend == "auto"):
        return "auto", None
    if _backends.is_exact(backend):
        return backend, None
    return "auto", (
        f"rollout, flow and norms are defined on exact softmax attention, so they ran on the exact "
        f"model (backend 'auto'), not on the approximate {_backends.get(backend).name!r} the other "
        "methods used"
    )


def flow_score(loaded, enc: dict, position: int, method: str, backend) -> tuple[list[float], str | None]:
    """``(score per token, a note or None)`` of one of :data:`FLOW_METHODS` for the input ``enc``
    (one sequence, as :meth:`LoadedModel.encode` gives it)."""
    note = None
    if method in ("rollout", "norm_rollout"):
        rows = rollout(
            loaded, enc, method="mean" if method == "rollout" else "norm", rows=[position], backend=backend
        ).rows
        assert rows is not None  # rows asked for
        row = rows[0]
    elif method == "attention_flow":
        res = attention_flow(loaded, enc, source=position, layer=-1, backend=backend)
        row = res.flow
        if res.gap > FLOW_GAP_NOTE:
            note = f"attention flow: certificate gap {res.gap:.2g} (upper minus lower bound of a max-flow value)"
    elif method == "attention_norm":
        nres = attention_norms(loaded, enc, layers=[-1], rows=[position], backend=backend)
        row = nres.row_layer[nres.layers[-1]][0]
    else:  # explain checks the names first
        raise KeyError(method)
    return [float(v) for v in row.tolist()], note


__all__ = ["FLOW_METHODS", "exact_backend", "flow_score"]
