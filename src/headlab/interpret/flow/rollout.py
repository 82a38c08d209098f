"""Attention rollout (Abnar and Zuidema 2020): :func:`rollout`.

Per layer the residual-augmented attention ``A_hat_l = 0.5 * A_l + 0.5 * I`` with rows renormalised
(a query row that sees no key keeps only its identity part), where ``A_l`` is

* ``method="mean"``: the mean over heads of the attention weights (the paper's definition);
* ``method="norm"``: the layer norm map of Kobayashi et al. (:func:`~headlab.interpret.flow.norms.attention_norms`,
  mode ``"attention"``), row-normalised.

The rollout through layer l is ``R_l = A_hat_l A_hat_(l-1) ... A_hat_0`` (``R_l[i, j]``: how much of
input token j reaches token i at the output of layer l).

Rows for chosen tokens of layer ``layer`` come top-down without any n x n map: ``r <- r A_hat_l``
for l = layer .. 0, each product a weighted column sum ``sum_i w_i P_h[i, j]`` computed tile by tile
from q, k and the log-sum-exp (:mod:`headlab.interpret.flow.tiles`): O((R + H) n) memory.

    >>> import torch, headlab
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=3, n_heads=4, causal=True)).eval()
    >>> ids = torch.randint(0, 50, (1, 20))
    >>> full = headlab.rollout(m, ids)
    >>> full.maps.shape
    torch.Size([3, 20, 20])
    >>> top = headlab.rollout(m, ids, rows=[19, 0])
    >>> torch.allclose(top.rows, full.maps[-1][[19, 0]], atol=1e-6)
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

import headlab.checks as checks
from headlab.errors import ConfigError, UnsupportedArchitectureError
from headlab.interpret.flow.gram import gram, layer_tile
from headlab.interpret.flow.norms import check_positions, maps_from_pattern
from headlab.interpret.flow.record import record
from headlab.interpret.flow.stacks import CHAINING, PerStack, each_stack, several_stacks
from headlab.interpret.flow.tiles import prob_tiles, weighted_colsum
from headlab.models.loader import resolve
from headlab.results import envelope

Method = Literal["mean", "norm"]


@dataclass
class RolloutResult:
    """``maps`` ``(n_layers, n, n)`` (``maps[l]`` the rollout through layer l) or ``rows`` ``(R, n)``: rows
    ``row_positions`` of the rollout through layer ``layer``."""

    method: str
    n: int
    layer: int
    tokens: list[str] | None
    maps: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    row_positions: list[int] | None = None
    stack: str | None = None  # the stack it ran within, on a model of several (an encoder-decoder)

    def _repr_html_(self) -> str:
        """This result's page inline in a notebook (headlab's shell in a sandboxed frame; no network)."""
        from headlab.interpret import shell
        from headlab.interpret.flow.page import flow_page

        return shell.inline(flow_page(self))

    def to_json(self) -> dict:
        d = {
            "method": self.method,
            "n": self.n,
            "layer": self.layer,
            "tokens": self.tokens,
            "row_positions": self.row_positions,
        }
        if self.maps is not None:
            d["maps"] = self.maps.tolist()
        if self.rows is not None:
            d["rows"] = self.rows.tolist()
        if self.stack is not None:
            d["stack"] = self.stack
        return envelope("rollout", d, settings={"method": self.method, "layer": self.layer, "rows": self.row_positions})


def augment(A: torch.Tensor) -> torch.Tensor:
    """``A_hat = (0.5 A + 0.5 I)`` with rows renormalised: ``(..., n, n)``."""
    n = A.shape[-1]
    a = 0.5 * A + 0.5 * torch.eye(n, dtype=A.dtype, device=A.device)
    return a / a.sum(-1, keepdim=True)


def rollout_maps(A_hat: torch.Tensor) -> torch.Tensor:
    """``R_l = A_hat_l R_(l-1)`` for ``A_hat (L, n, n)``: ``(L, n, n)``."""
    out = [A_hat[0]]
    for l in range(1, A_hat.shape[0]):
        out.append(A_hat[l] @ out[-1])
    return torch.stack(out)


def _row_normalise(N: torch.Tensor) -> torch.Tensor:
    s = N.sum(-1, keepdim=True)
    return N / torch.where(s > 0, s, torch.ones_like(s))


def layer_matrices(rec, method: str) -> torch.Tensor:
    """``A_l`` ``(L, n, n)`` of the recorded layers (maps mode)."""
    mats = []
    for l, lr in sorted(rec.layers.items()):
        if method == "mean":
            mats.append(lr.pattern.double().mean(0))
        else:
            mats.append(
                _row_normalise(maps_from_pattern(lr.pattern.double(), gram(rec.adapter, l, lr, "attention"))[1])
            )
    return torch.stack(mats)


def _check_layer(adapter, layer) -> int:
    L = adapter.n_layers
    return checks.index(
        "layer",
        layer,
        L,
        message="layer {value!r} out of range: the model has {length} layers (0..{high}, or -1 for the last)",
    )


def _step_mean(lr, r, scale, causal):
    """``r A_hat_l`` for the mean-attention rollout, ``r (R, n)``."""
    vis = (~torch.isneginf(lr.lse)).to(r.dtype).mean(0)  # (n,) row sums of mean_h P
    w = r / (0.5 * vis + 0.5)
    cs = weighted_colsum(lr.q, lr.k, lr.lse, w, scale=scale, causal=causal).to(r.dtype).mean(0)  # (R, n)
    return 0.5 * cs + 0.5 * w


def _step_norm(adapter, l, lr, r, scale, causal, block=512):
    """``r A_hat_l`` for the norm-based rollout: two tile passes (row sums of N, then ``(w / rowsum) N``)."""
    ng = gram(adapter, l, lr, "attention")
    n = r.shape[-1]
    rows = torch.zeros(n, dtype=r.dtype, device=r.device)
    for r0, r1, c0, c1, p in prob_tiles(lr.q, lr.k, lr.lse, scale=scale, causal=causal, block=block):
        rows[r0:r1] += layer_tile(p, torch.arange(r0, r1, device=r.device), c0, c1, ng).sum(-1).to(r.dtype)
    live = (rows > 0).to(r.dtype)
    w = r / (0.5 * live + 0.5)
    wn = w / torch.where(rows > 0, rows, torch.ones_like(rows))
    out = torch.zeros_like(r)
    for r0, r1, c0, c1, p in prob_tiles(lr.q, lr.k, lr.lse, scale=scale, causal=causal, block=block):
        N = layer_tile(p, torch.arange(r0, r1, device=r.device), c0, c1, ng).to(r.dtype)  # (bq, bk)
        out[:, c0:c1] += wn[:, r0:r1] @ N
    return 0.5 * out + 0.5 * w


def stack_layers(adapter, stack: str | None) -> list[int]:
    """The layers rollout multiplies: the one stack of most models; an encoder-decoder's ``"encoder"`` or
    ``"decoder"`` (self-attention), each by Abnar and Zuidema's definition within the stack. A model with blocks
    that mix tokens without attention (a hybrid's SSM or convolution blocks) is refused with the reason."""
    if getattr(adapter, "chain_refusal", ""):  # headlab.models.hf.hybrid
        raise UnsupportedArchitectureError(adapter.chain_refusal)
    stacks = adapter.stacks
    if stack is None:
        if len(stacks) == 1:
            return next(iter(stacks.values()))
        raise ConfigError(
            f"this model has the stacks {', '.join(stacks)}: rollout runs within one; pass "
            "stack='encoder' or stack='decoder'"
        )
    if stack == "cross":
        raise ConfigError(
            "rollout multiplies a stack's maps with the identity added for the residual; cross-attention "
            "maps decoder tokens onto encoder tokens, so they do not chain: use stack='encoder' or 'decoder'"
        )
    if stack not in stacks:
        raise ConfigError(f"unknown stack {stack!r}; this model has {', '.join(stacks)}")
    return stacks[stack]


def rollout(
    loaded,
    text_or_inputs,
    *,
    method: Method = "mean",
    rows=None,
    layer: int = -1,
    backend="auto",
    stack: str | None = None,
) -> RolloutResult | PerStack:
    """Attention rollout of one input.

    Args:
        loaded: a :class:`~headlab.models.loader.LoadedModel`, a model adapter or a supported model.
        text_or_inputs: one text (with a LoadedModel), an ``input_ids`` tensor ``(1, n)`` or a dict.
        method: ``"mean"`` (mean of heads, Abnar and Zuidema) or ``"norm"`` (the layer norm map).
        rows: token positions at the output of ``layer``: return those rows of the rollout through
            ``layer``, computed top-down without n x n maps (long inputs). None: every full map.
        layer: the top layer for ``rows`` (default the last).
        backend: the exact backend the model runs on (an approximate one is refused).
        stack: for an encoder-decoder, ``"encoder"`` or ``"decoder"``: the rollout within that stack
            (``layer`` then indexes the model's attention layers, as gates do; the result's ``stack`` names it).
            None on an encoder-decoder: a :class:`~headlab.interpret.flow.stacks.PerStack`, ``{"encoder":
            RolloutResult, "decoder": RolloutResult}``, each what naming that stack gives, with notes saying
            so (cross-attention does not chain and is left out); with ``layer`` given, the stack holding it.
    """
    if method not in ("mean", "norm"):
        raise ConfigError(f"unknown rollout method {method!r}; use 'mean' (mean of heads) or 'norm' (norm maps)")
    adapter, _ = resolve(loaded)
    again = dict(method=method, rows=rows, layer=layer, backend=backend)
    if stack is None and several_stacks(adapter):
        if layer != -1:  # the stack holding that layer (cross-attention: refused below, with the reason)
            at = _check_layer(adapter, layer)
            stack = next((s for s in CHAINING if at in adapter.stacks.get(s, ())), "cross")
            return rollout_one(loaded, text_or_inputs, **again, stack=stack)  # type: ignore[arg-type]
        return each_stack(adapter, lambda s: rollout_one(loaded, text_or_inputs, **again, stack=s), "rollout")  # type: ignore[arg-type]
    return rollout_one(loaded, text_or_inputs, **again, stack=stack)  # type: ignore[arg-type]


def rollout_one(
    loaded,
    text_or_inputs,
    *,
    method: Method = "mean",
    rows=None,
    layer: int = -1,
    backend="auto",
    stack: str | None = None,
) -> RolloutResult:
    """:func:`rollout` within one stack: the model's only one, or the one named (an encoder-decoder without
    ``stack=`` is a :class:`~headlab.errors.ConfigError` asking for one)."""
    if method not in ("mean", "norm"):
        raise ConfigError(f"unknown rollout method {method!r}; use 'mean' (mean of heads) or 'norm' (norm maps)")
    adapter, _ = resolve(loaded)
    chain = stack_layers(adapter, stack)
    named = stack if len(adapter.stacks) > 1 else None
    top = chain[-1] if layer == -1 else _check_layer(adapter, layer)
    if top not in chain:
        raise ConfigError(f"layer {layer} is not in the stack rollout runs through (layers {chain[0]}..{chain[-1]})")
    if rows is None:
        rec = record(loaded, text_or_inputs, chain, maps=True, backend=backend)
        with torch.no_grad():
            maps = rollout_maps(augment(layer_matrices(rec, method))).float()
        return RolloutResult(method, rec.n, chain[-1], rec.tokens, maps=maps, stack=named)
    rec = record(loaded, text_or_inputs, [l for l in chain if l <= top], maps=False, backend=backend)
    pos = check_positions("rows", rows, rec.n)
    with torch.no_grad():
        first = rec.layers[chain[0]]
        assert first.q is not None  # recorded without maps: q and k are kept
        ct = torch.float64 if first.q.dtype == torch.float64 else torch.float32
        r = torch.zeros(len(pos), rec.n, dtype=ct, device=first.q.device)
        r[torch.arange(len(pos)), torch.tensor(pos)] = 1.0
        for l in sorted(rec.layers, reverse=True):
            lr = rec.layers[l]
            if method == "mean":
                r = _step_mean(lr, r, rec.scale[l], rec.causal)
            else:
                r = _step_norm(adapter, l, lr, r, rec.scale[l], rec.causal)
    return RolloutResult(method, rec.n, top, rec.tokens, rows=r.float(), row_positions=pos, stack=named)


__all__ = ["RolloutResult", "augment", "layer_matrices", "rollout", "rollout_maps", "rollout_one"]
