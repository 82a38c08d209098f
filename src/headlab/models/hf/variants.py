"""Why a module that calls the attention function more than once is refused: shared weights or differential attention.

One attention module may appear in several attention calls of one forward for two reasons that need different
declarations. It serves several layers (ALBERT shares one block across all layers: one call per forward of the
module), or it computes several weight maps per layer (differential attention, DiffLlama: two calls per forward
of the module, whose weight maps are subtracted, ``softmax(q1 k1) - lambda softmax(q2 k2)``, then a sub-norm before
the output projection). :func:`repeated_calls_reason` tells them apart by counting the module's forwards in one run.
:func:`stacks_reason` says why an encoder-decoder's calls make no three stacks (LongT5's blocked local attention).
"""

from __future__ import annotations

from torch import nn

from headlab.models.hf.trace import trace


def repeated_calls_reason(model: nn.Module, x: dict, modules: list[nn.Module], calls: list, paths: dict) -> str:
    """The refusal's reason for attention modules seen in several calls (``calls``: the traced attention calls)."""
    count = {id(m): 0 for m in modules}
    handles = [
        m.register_forward_pre_hook(lambda mod, args: count.__setitem__(id(mod), count[id(mod)] + 1)) for m in modules
    ]
    try:
        trace(model, x)
    finally:
        for h in handles:
            h.remove()
    per_forward = {}
    for m in modules:
        n_calls = sum(c.module is m for c in calls)
        if n_calls > 1 and count[id(m)]:
            per_forward[id(m)] = n_calls / count[id(m)]
    # inside a block (its path has a block index), not a module holding the whole stack
    multi = [
        m
        for m in modules
        if per_forward.get(id(m), 1) > 1 and any(p.isdigit() for p in paths.get(id(m), '').split('.'))
    ]
    if multi:
        k = per_forward[id(multi[0])]
        subnorm = next((n for n, c in multi[0].named_modules() if n and "norm" in type(c).__name__.lower()), None)
        return (
            f"its attention module {paths.get(id(multi[0]), type(multi[0]).__name__)} makes {k:g} attention calls "
            "each time it runs: differential attention (as DiffLlama: two weight maps per head, the second scaled "
            "by a learned lambda and subtracted"
            + (f", then the sub-norm {subnorm!r} before the output projection" if subnorm else "")
            + "), which headlab's view of one weight map per head cannot express; a family class must declare "
            "both maps, lambda and how they combine"
        )
    return (
        "one attention module serves several layers (shared weights); a family class must say "
        "which layers share it (see the ALBERT family)"
    )


def stacks_reason(model: nn.Module, stacks: dict, encoder: nn.Module | None) -> str:
    """Why an encoder-decoder's attention calls do not split into encoder, decoder and cross-attention: an encoder
    whose attention modules make no call of the interface (LongT5's local and transient-global attention, which
    computes its scores over blocks of the sequence in its own module) is named as that."""
    found = sorted(stacks)
    if "encoder" not in stacks and encoder is not None:
        own = [
            (n, type(m).__name__)
            for n, m in encoder.named_modules()
            if n
            and "attention" in type(m).__name__.lower()
            and not any(c is not m and "attention" in type(c).__name__.lower() for c in m.children())
        ]
        kind = str(getattr(model.config, "encoder_attention_type", "") or "")
        blocked = [t for n, t in own if any(w in t.lower() for w in ("local", "transientglobal", "global"))]
        if blocked or kind in ("local", "transient-global"):
            where = f"{own[0][0]!r} ({blocked[0] if blocked else own[0][1]})" if own else "its encoder"
            return (
                f"its encoder's attention {where} is local / transient-global attention over blocks: it splits "
                "the sequence into blocks, computes each block's scores against its neighbours (and, "
                "transient-global, against per-block summary tokens) in its own module, and never calls "
                "transformers' attention interface, so no (n x n) weight map per head exists to capture or "
                "check; a family class would have to declare the block length (local_radius + 1), the global "
                "tokens, and how the blocked scores map to the n x n pattern"
            )
        if own:
            return (
                f"its encoder's attention modules ({own[0][0]!r}, {own[0][1]}) never call transformers' attention "
                f"interface while its decoder's do (calls split into {found}); a family class must declare the "
                "encoder's attention"
            )
    return f"an encoder-decoder whose attention calls split into {found}, not encoder, decoder and cross-attention"


__all__ = ["repeated_calls_reason", "stacks_reason"]
