"""Retrieval heads (Wu et al. 2024): which heads copy the needle while the model retrieves it.

On a needle-in-a-haystack prompt the model decodes greedily, one token per step. At the step that
generates token ``w``, head h *copies* when the key it attends to most (the argmax of its attention row
for the last position) lies inside the needle span and holds the token ``w``. A trial's retrieval score is

    hits(h) / len(answer)

and the atlas's score the mean over trials. Wu et al. divide by the needle's length and ask for the
whole needle; here the query already repeats the needle's opening words and the model is asked for the
rest (the *answer*), so the answer's length is the most a head can copy. Like them, the argmax is the
top-1 key, read from the map-free statistics (``blocks.L.attn.stats``, ``argmax``): after decoding, one
forward of ``prompt + generated[:-1]`` gives, in row ``len(prompt) - 1 + t``, exactly the attention of
the step that generated token t (causal attention never looks ahead).

    >>> import torch
    >>> ids = torch.tensor([5, 7, 8, 9, 5, 7])                   # needle 7 8 9 at positions 1..3
    >>> argmax = torch.tensor([[[2, 3], [0, 3]]])                # (layers=1, H=2, steps=2)
    >>> copy_hits(argmax, ids, generated=torch.tensor([8, 9]), needle=(1, 4)).tolist()   # (layers, H)
    [[2.0, 1.0]]
"""

from __future__ import annotations

import torch

from headlab.interpret.atlas.tasks import Needle
from headlab.interpret.capture import capture


def copy_hits(
    argmax: torch.Tensor, ids: torch.Tensor, generated: torch.Tensor, needle: tuple[int, int]
) -> torch.Tensor:
    """``(n_layers, H)`` copy events: ``argmax`` ``(n_layers, H, steps)`` the top-attended key of each
    decoding step, ``ids`` ``(L,)`` the tokens at the keys, ``generated`` ``(steps,)``, ``needle`` a span."""
    lo, hi = needle
    inside = (argmax >= lo) & (argmax < hi)
    at = ids[argmax.clamp(0, len(ids) - 1)]  # (n_layers, H, steps) token at the attended key
    return (inside & (at == generated.to(ids.device)[None, None])).sum(-1).to(torch.float64)


def greedy(adapter, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """``(steps,)`` tokens decoded greedily after ``ids`` ``(L,)`` (full forwards; no cache)."""
    seq = ids[None]
    out = []
    with torch.no_grad():
        for _ in range(steps):
            o = adapter.forward({"input_ids": seq, "attention_mask": torch.ones_like(seq)})
            nxt = o.logits[0, -1].argmax()
            out.append(int(nxt))
            seq = torch.cat([seq, nxt.view(1, 1)], 1)
    return torch.tensor(out, dtype=torch.long)


def _record(adapter, full: torch.Tensor):
    return capture(
        adapter,
        {"input_ids": full[None], "attention_mask": torch.ones(1, len(full), dtype=torch.long)},
        adapter.sites("stats"),
        stats_kwargs={"stats": ["argmax"]},
    )


def retrieval_trial(adapter, trial: Needle) -> dict:
    """One trial: the generated answer, whether it is right, and each head's score ``(n_layers, H)``.

    Greedy decoding costs one forward when the model retrieves the needle: the forward of ``prompt +
    answer[:-1]`` predicts, at the answer's rows, what greedy decoding would generate as long as it has
    generated the answer so far; only from the first miss on does it decode step by step."""
    n, P = len(trial.answer), len(trial.ids)
    full = torch.cat([trial.ids, trial.answer[:-1]])
    cache = _record(adapter, full)
    pred = cache.outputs.logits[0, P - 1 : P - 1 + n].argmax(-1).cpu()
    miss = (pred != trial.answer).nonzero()
    if len(miss):  # greedy leaves the answer at step m: decode the rest, then record the generated sequence
        m = int(miss[0])
        head = torch.cat([trial.answer[:m], pred[m : m + 1]])
        gen = torch.cat([head, greedy(adapter, torch.cat([trial.ids, head]), n - m - 1)])
        full = torch.cat([trial.ids, gen[:-1]])
        cache = _record(adapter, full)
    else:
        gen = trial.answer.clone()
    rows = torch.arange(P - 1, P - 1 + n)
    H = adapter.n_heads
    argmax = torch.full((adapter.n_layers, H, n), -1, dtype=torch.long)
    for layer in range(adapter.n_layers):
        a = cache[adapter.site_name(layer, "stats")].argmax[0][:, rows]  # (H_l, n)
        argmax[layer, : a.shape[0]] = a
    hits = copy_hits(argmax, full, gen, trial.needle)
    return {
        "generated": gen.tolist(),
        "exact": bool(torch.equal(gen, trial.answer)),
        "token_accuracy": float((gen == trial.answer).double().mean()),
        "score": hits / n,
    }


__all__ = ["copy_hits", "greedy", "retrieval_trial"]
