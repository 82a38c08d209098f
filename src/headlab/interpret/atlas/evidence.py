"""Evidence maps: the attention pattern of each kind's top heads on one short input, for the page.

A score is a mean; the map shows what it averages. For the top-k heads of every kind that reads the
repeated random tokens (previous_token, duplicate_token, induction: ``Kind.reads``), the map on a short
repeated random sequence (at most 12 tokens per half: the induction stripe sits ``T - 1`` keys left of the
diagonal); for every kind that reads the natural text (sink, local), on the first 24 tokens of the first
natural-text piece; kinds of other inputs have none. The maps are materialised (``blocks.L.attn.pattern``), which short inputs
allow; the scores themselves never need them.

    >>> import torch
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> m = Transformer(TransformerConfig(vocab_size=30, d_model=16, n_layers=1, n_heads=2, causal=True)).eval()
    >>> ev = evidence_maps(m, {"induction": [(0, 1)]}, repeated_ids=torch.arange(1, 9).repeat(2), text_ids=None,
    ...                    tokens=str)
    >>> ev["induction:0.1"]["kind"], len(ev["induction:0.1"]["map"]), len(ev["induction:0.1"]["tokens"])
    ('induction', 16, 16)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from headlab.interpret.atlas.kinds import KINDS
from headlab.interpret.atlas.kinds.shared import INPUTS
from headlab.interpret.capture import capture
from headlab.models.loader import resolve


def evidence_maps(
    model,
    heads: dict[str, list[tuple[int, int]]],
    *,
    repeated_ids: torch.Tensor | None,
    text_ids: torch.Tensor | None,
    tokens: Callable[[int], str],
) -> dict[str, dict]:
    """``{"kind:l.h": {"kind", "layer", "head", "tokens", "map" (n x n, 3 decimals)}}`` for ``heads[kind]``.

    ``repeated_ids`` / ``text_ids``: ``(n,)`` inputs for the kinds that read the repeated tokens and the text;
    ``tokens``: id -> the string shown for it."""
    adapter, _ = resolve(model)
    out: dict[str, dict] = {}
    for ids, source in zip((repeated_ids, text_ids), INPUTS):
        wanted = [(kd, hd) for kd in KINDS if KINDS[kd].reads == source for hd in heads.get(kd, [])]
        if ids is None or not wanted:
            continue
        x = ids[None]
        cache = capture(adapter, {"input_ids": x, "attention_mask": torch.ones_like(x)}, adapter.sites("pattern"))
        strs = [tokens(int(t)) for t in ids.tolist()]
        for kd, (layer, h) in wanted:
            p = cache[adapter.site_name(layer, "pattern")][0, h]  # (n, n)
            out[f"{kd}:{layer}.{h}"] = {
                "kind": kd,
                "layer": layer,
                "head": h,
                "tokens": strs,
                "map": [[round(float(v), 3) for v in row] for row in p.tolist()],
            }
    return out


__all__ = ["evidence_maps"]
