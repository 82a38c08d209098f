"""KV-cache policies per kv head: which keys each head keeps while a model decodes.

A **rule** says what one kv head of one layer holds:

- :data:`full` keeps every key (the ordinary cache);
- :func:`window(sink, recent) <window>` keeps the first ``sink`` keys and the last ``recent`` ones
  (StreamingLLM's attention sinks plus a sliding window, Xiao et al. 2024);
- :data:`drop` keeps nothing: the kv head is pruned, with the query heads that read it (their
  output is zero, as if their W^O columns were removed);
- :func:`snap(budget, window, pool) <snap>` keeps, after the prefill, the ``budget`` prompt tokens its
  observation window (the last ``window`` prompt queries) attends to most, then every new token (SnapKV,
  Li et al. 2024); :func:`adakv` lets the heads of a layer share one budget, allocated by their scores
  jointly with a floor per head (Ada-KV, Feng et al. 2024). What they keep depends on the prompt.

Full and windowed rules also carry a precision, ``bits`` 16 (the cache's dtype), 8, 4 or 2: keys per
channel and values per token in asymmetric min-max groups, the most recent tokens in full precision
(Liu et al. 2024, KIVI): ``kv.full(bits=4)``, ``kv.window(4, 256, bits=2)``. A window may also keep
RazorAttention's compensation token (Tang et al. 2024), the mean of the keys and values it evicted:
``kv.window(4, 256, compensate=True)``. What a rule holds after ``n`` tokens is :meth:`Full.layout`
(:class:`Layout`), from which :mod:`headlab.costs.kv` counts the bytes.

A :class:`Policy` maps ``(layer, kv_head)`` to a rule. Keys keep their original positions (rotary
embeddings are applied before caching), so decoding under a policy is *one forward* in which key
``j`` is visible to query ``t`` when ``j <= t`` and ``(j < sink or t - j < recent)`` for windowed heads,
``j <= t`` for full heads, and nothing for dropped heads (:meth:`Policy.visible`). Grouped-query
models share one kv head among several query heads: a kv head is kept full when any of its query
heads needs the whole context (the constructors that rank heads take the maximum over the group).

The rules live in :mod:`headlab.decode.rules` (what a rule is, :class:`Rule`, and the registry of kinds; full, drop,
window) and :mod:`headlab.decode.snap_rule` (SnapKV, Ada-KV), the policy in :mod:`headlab.decode.policy`
(:func:`as_rule`, a rule from its text through the registry, and :class:`Policy`); this module re-exports them,
with :func:`kv_layout` and :func:`check_decoder`.

    >>> from headlab import kv
    >>> p = kv.Policy.from_spec({(0, 1): kv.window(sink=1, recent=2), (1, 0): kv.drop}, default="full")
    >>> p.rule(0, 1), p.rule(1, 0), p.rule(1, 1)
    (window(sink=1, recent=2), drop, full)
    >>> p.visible(0, 1, 5).int()            # query t sees keys j <= t with j < 1 or t - j < 2
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 0, 1, 1, 0],
            [1, 0, 0, 1, 1]], dtype=torch.int32)
    >>> p.kept(1000, [2, 2])                 # keys held per (layer, kv head) after 1000 tokens
    [[1000, 3], [0, 1000]]
"""

from __future__ import annotations

from headlab.decode.expected import Expected, expected  # noqa: F401  (re-exported; registers expected:BUDGET)
from headlab.decode.heads import check_decoder, kv_layout  # noqa: F401  (re-exported)
from headlab.decode.layout import Layout, key_boundary, value_boundary  # noqa: F401  (re-exported)
from headlab.decode.policy import Policy, as_rule, visibility  # noqa: F401  (re-exported)
from headlab.decode.rules import (  # noqa: F401  (re-exported)
    BITS,
    GROUP,
    RESIDUAL,
    RULES,
    Drop,
    Full,
    Rule,
    Window,
    drop,
    full,
    register_rule,
    unknown_rule,
    unregister_rule,
    window,
)
from headlab.decode.snap_rule import POOLINGS, Snap, adakv, snap  # noqa: F401  (re-exported)

__all__ = [
    "Full",
    "Window",
    "Drop",
    "Snap",
    "Rule",
    "Layout",
    "full",
    "drop",
    "window",
    "snap",
    "adakv",
    "Policy",
    "kv_layout",
    "as_rule",
    "RULES",
    "register_rule",
    "unregister_rule",
    "Expected",
    "expected",
]


def __getattr__(name: str):
    """The gate training's names (``kv.GateTraining``, ``kv.train_gates``, ``kv.per_query_head``), loaded on first use:
    training imports transformers, and parsing or checking a policy (the commands' refusals) should not."""
    if name in ("GateTraining", "per_query_head", "train_gates"):
        from headlab.decode import train

        return getattr(train, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
