"""Reading the residual stream out: the logit lens and direct logit attribution (DLA).

**Logit lens** (nostalgebraist 2020): the stream after every block, read out as if it were the last,
``logits_l = norm(resid_l) @ W_U^T + b_U``; entry 0 is the embeddings (``resid_pre`` of block 0), entry
``l + 1`` the output of block ``l`` (``resid_post``), so the last entry is the model's own logits.

**Direct logit attribution**: in a block that adds its attention to the stream (pre-norm and parallel
blocks), head h of layer l writes ``head_out[l, h] = z_h @ W_O[h]`` straight into the stream, and the
final stream is the sum of every such write plus the rest (embeddings, MLPs, output biases). With the
final norm's divisor ``s`` frozen at its value on this run (:mod:`headlab.models.readout`), each part's
share of the logit difference ``correct - wrong`` at the answer position is::

    DLA[l, h] = (g * P(head_out[l, h]) / s) . (W_U[correct] - W_U[wrong])

and ``sum_{l,h} DLA[l, h] + rest`` equals the model's own logit difference on this run (``rest`` is the
same projection of everything else, plus the norm's and the unembedding's biases). The equality is
exact; what is approximate is reading a term as "the head's effect": the divisor depends on the whole
stream, so removing a head would also change ``s`` (the norm's *linearisation*). Post-norm and sandwich
blocks pass the heads' output through another norm before the stream, so they have no such terms and
are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from headlab.errors import ShapeError, UnsupportedArchitectureError
from headlab.interpret.capture import capture
from headlab.interpret.capture.run import prepare_inputs
from headlab.interpret.patching.metrics import check_position, ids_of, logit_rows
from headlab.models.loader import resolve
from headlab.models.tp_weights import readout as readout_of  # the unembedding whole under tensor parallelism
from headlab.results import envelope


def _at(t: torch.Tensor, position) -> torch.Tensor:
    """``t (B, L, ...)`` at each example's position: ``(B, ...)``; a position out of range is an
    InputError (never wrapped round to another position)."""
    B, L = t.shape[:2]
    pos = check_position(position, L, B).to(t.device)
    return t[torch.arange(B, device=t.device), pos]


def _check_position_before(inputs, position) -> int | None:
    """The position checked against the inputs' ``(B, L)`` before any forward; the batch size, or None
    when the inputs do not show their shape (the check then runs on the recorded tensors)."""
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        check_position(position, int(ids.shape[1]), int(ids.shape[0]))
        return int(ids.shape[0])
    return None


@dataclass
class LensResult:
    """``logits (n_layers + 1, B, V)`` at each example's position: entry 0 the embeddings, entry l + 1 block l's output."""

    logits: torch.Tensor

    def logit_diff(self, correct, wrong) -> torch.Tensor:
        """``(n_layers + 1, B)``: logit of ``correct`` minus ``wrong`` (one id, or one per example) at every depth."""
        S, B, V = self.logits.shape
        c, w = ids_of(correct, "correct", V).expand(B), ids_of(wrong, "wrong", V).expand(B)
        ar = torch.arange(B)
        return self.logits[:, ar, c] - self.logits[:, ar, w]

    def top(self, k: int = 5, example: int = 0) -> list[list[int]]:
        """The ``k`` highest-scoring token ids at every depth, for one example."""
        return torch.topk(self.logits[:, example], k, dim=-1).indices.tolist()

    def to_json(self, k: int = 5) -> dict:
        return envelope(
            "logit_lens",
            {
                "kind_of_result": "logit_lens",
                "depths": int(self.logits.shape[0]),
                "top": [self.top(k, b) for b in range(self.logits.shape[1])],
            },
            settings={"k": k},
        )


def logit_lens(model, inputs, *, position=-1, backend: str | None = None) -> LensResult:
    """The stream after every block read out through the final norm and the unembedding (see the module docstring).

    Args:
        model: a language model (LoadedModel, module or adapter) with one stack of blocks.
        inputs: text (with a LoadedModel), ``input_ids (B, L)`` or a dict of tensors.
        position: the position read (int, or one per example: the last real token of padded prompts).
    """
    adapter, loaded = resolve(model)
    readout = readout_of(adapter)
    n = adapter.n_layers
    prepared = prepare_inputs(inputs, loaded)
    _check_position_before(prepared, position)
    cache = capture(
        adapter,
        prepared,
        [adapter.site_name(0, "resid_pre"), *(adapter.site_name(l, "resid_post") for l in range(n))],
        backend=backend,
    )
    states = [cache[adapter.site_name(0, "resid_pre")]] + [cache[adapter.site_name(l, "resid_post")] for l in range(n)]
    with torch.no_grad():
        logits = torch.stack([readout.logits(_at(s, position)) for s in states])  # (n + 1, B, V)
    return LensResult(logits.float())


@dataclass
class DLAResult:
    """Direct logit attribution of every head. ``per_example (B, n_layers, H)``; ``heads`` its mean over examples.

    ``rest (B,)``: everything else (embeddings, MLPs, output biases, the norm's and unembedding's biases);
    ``logit_diff (B,)``: the model's own; ``per_example.sum((1, 2)) + rest == logit_diff``."""

    model: str
    heads: torch.Tensor  # (n_layers, H)
    per_example: torch.Tensor  # (B, n_layers, H)
    rest: torch.Tensor  # (B,)
    logit_diff: torch.Tensor  # (B,)

    def top(self, k: int = 10) -> list[tuple[int, int, float]]:
        """Heads by ``|DLA|`` (mean over examples): ``[(layer, head, value), ...]``."""
        flat = self.heads.flatten()
        H = self.heads.shape[1]
        return [(int(i) // H, int(i) % H, float(flat[i])) for i in torch.argsort(flat.abs(), descending=True)[:k]]

    def to_json(self) -> dict:
        return envelope(
            "direct_logit_attribution",
            {
                "kind_of_result": "direct_logit_attribution",
                "model": self.model,
                "heads": np.round(self.heads.double().numpy(), 6).tolist(),
                "rest": self.rest.tolist(),
                "logit_diff": self.logit_diff.tolist(),
                "top": [list(t) for t in self.top()],
                "note": "terms at the run's final-norm scale (frozen); heads + rest = the model's logit difference",
            },
            model=self.model,
        )


def direct_logit_attribution(model, inputs, correct, wrong, *, position=-1, backend: str | None = None) -> DLAResult:
    """Each head's direct share of the logit difference ``correct - wrong`` (see the module docstring).

    Args:
        model: a language model whose blocks add attention to the stream (pre-norm or parallel layout).
        inputs: as :func:`logit_lens`. correct, wrong: a token id, or one per example.
        position: where the answer is predicted (int, or one per example).
    """
    adapter, loaded = resolve(model)
    layouts = {adapter.attention_norm(l).layout for l in range(adapter.n_layers)}
    if layouts - {"pre", "parallel"}:
        raise UnsupportedArchitectureError(
            f"direct logit attribution needs blocks that add each head's output to the stream as it is; this model's "
            f"blocks are {', '.join(sorted(layouts))} (a norm between the heads and the stream)"
        )
    if any(adapter.attention_norm(l).branch_scale is not None for l in range(adapter.n_layers)):
        raise UnsupportedArchitectureError(
            "direct logit attribution needs blocks that add each head's output to the stream as it is; this model "
            "scales its attention branch first (LayerScale or a residual multiplier)"
        )
    readout = readout_of(adapter)
    n = adapter.n_layers
    V = readout.W_U.shape[0]
    c0, w0 = ids_of(correct, "correct", V), ids_of(wrong, "wrong", V)
    prepared = prepare_inputs(inputs, loaded)
    B0 = _check_position_before(prepared, position)
    for name, t in (("correct", c0), ("wrong", w0)):
        if B0 is not None and t.numel() not in (1, B0):
            raise ShapeError(f"{name} has {t.numel()} ids for a batch of {B0}; give one id or one per example")
    last = adapter.site_name(n - 1, "resid_post")
    cache = capture(adapter, prepared, [last, *(adapter.site_name(l, "head_out") for l in range(n))], backend=backend)
    with torch.no_grad():
        x = _at(cache[last], position)  # (B, E): the final norm's input
        B = x.shape[0]
        c, w = c0.expand(B), w0.expand(B)
        direction = readout.W_U[c] - readout.W_U[w]  # (B, E)
        s = readout.scale(x)  # (B, 1)
        outs = torch.stack(
            [_at(cache[adapter.site_name(l, "head_out")].transpose(1, 2), position) for l in range(n)], 1
        )  # (B, n, H, E)
        per = (readout.linear(outs, s[:, None, None]) * direction[:, None, None]).sum(-1)  # (B, n, H)
        rest = ((readout.linear(x - outs.sum((1, 2)), s) + readout.bias) * direction).sum(-1)  # (B,)
        if readout.b_U is not None:
            rest = rest + readout.b_U[c] - readout.b_U[w]
        rows = logit_rows(cache.outputs.logits, position)  # (B, V): the model's own logits
        ld = rows[torch.arange(B), c] - rows[torch.arange(B), w]
    name = getattr(loaded, "name", None) or type(adapter.model).__name__
    return DLAResult(name, per.mean(0).float(), per.float(), rest.float(), ld.float())


__all__ = ["DLAResult", "LensResult", "direct_logit_attribution", "logit_lens"]
