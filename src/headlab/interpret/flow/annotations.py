"""Per-head notes for ``headlab analyze``: how much weight vs how much norm a head puts on the first key.

>>> import torch, headlab
>>> from headlab.models.transformer import Transformer, TransformerConfig
>>> m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4)).eval()
>>> r = headlab.attention_norms(m, torch.randint(0, 50, (1, 9)), stream=True, key_positions=[0])
>>> notes = head_annotations(r)
>>> sorted(notes)[:2], notes[(0, 0)].startswith("first token: weight")
([(0, 0), (0, 1)], True)
"""

from __future__ import annotations

from pathlib import Path

import torch

from headlab.errors import InputError


def _per_layer(result_or_path) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """layer -> (key_weight (H, n, M), key_norm_share (H, n, M)) from a NormsResult or its saved JSON."""
    if isinstance(result_or_path, (str, Path)):
        p = Path(result_or_path)
        if not p.is_file():
            raise InputError(
                f"{p} is not a file; give the norms.json that `headlab flow --method norms --out DIR` writes"
            )
        from headlab.reading import read_json_file

        raw = read_json_file(p, what="the norms.json that `headlab flow --method norms --out DIR` writes")
        summaries = raw.get("summaries")
        if not summaries:
            raise InputError(f"{p} holds no norm summaries (write it with `headlab flow --method norms --out DIR`)")
        return {
            int(l): (torch.tensor(s["key_weight"]), torch.tensor(s["key_norm_share"])) for l, s in summaries.items()
        }
    summaries = getattr(result_or_path, "summaries", None)
    if not summaries:
        raise InputError("head_annotations needs norm summaries: headlab.attention_norms(..., stream=True)")
    return {l: (s.key_weight, s.key_norm_share) for l, s in summaries.items()}


def head_annotations(result_or_path) -> dict[tuple[int, int], str]:
    """``(layer, head) -> "first token: weight 0.62, norm 0.19"``: mean over queries of the attention
    weight and of the norm share on the first chosen key (``key_positions[0]``, default the first token)."""
    out = {}
    for l, (kw, kn) in sorted(_per_layer(result_or_path).items()):
        w, nm = kw[..., 0].mean(-1), kn[..., 0].mean(-1)  # (H,)
        for h in range(w.shape[0]):
            out[(l, h)] = f"first token: weight {float(w[h]):.2f}, norm {float(nm[h]):.2f}"
    return out


__all__ = ["head_annotations"]
