"""How a model reads its residual stream out into logits: the final norm and the unembedding.

``logits = norm(x) @ W_U^T + b_U`` for the stream ``x`` leaving the last block. :func:`readout_of` finds the
two pieces in any adapted language model without knowing its family: ``W_U`` is the model's output
embedding (``get_output_embeddings()``; headlab's own Transformer ties it to ``tok_emb``), and the final norm is the last module whose output the
unembedding reads, found by one short run; the rebuilt logits are checked against the model's own, so a
model that does more after its unembedding (a logit scale, soft-capping) is refused, never misread.

Every final norm met in practice has the form ``norm(x) = g * P(x) / s(x) + b``, with ``P`` centring the
features (LayerNorm) or not (RMSNorm), ``s(x)`` a scalar per position, ``g`` its gain (Gemma's ``1 + w``
included) and ``b`` its bias. :class:`Readout` reads ``b = norm(0)``, ``g`` from a large +/-1 input and
``P`` from a shift test, and checks the form on the real stream. With ``s`` frozen at a run's value the
norm is linear, which is what direct logit attribution needs: the stream's parts then add up, term by
term, to the logits the model computed at that run (the *linearisation*: the scale itself depends on
the whole stream, so a term is "this part's share at the clean run's scale", not the change that
removing the part would make).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from headlab.errors import UnsupportedArchitectureError


@dataclass
class Readout:
    """The final norm (None: the model has none) and the unembedding ``W_U (V, E)``, ``b_U (V,)`` or None."""

    norm: nn.Module | None
    W_U: torch.Tensor
    b_U: torch.Tensor | None
    centred: bool  # the norm subtracts the mean of the features (LayerNorm); False: RMSNorm or no norm
    gain: torch.Tensor  # (E,) g
    bias: torch.Tensor  # (E,) b = norm(0)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.norm is None else self.norm(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., V)`` logits of stream states ``x (..., E)``."""
        out = self.normed(x).to(self.W_U.dtype) @ self.W_U.T
        return out if self.b_U is None else out + self.b_U

    def centre(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True) if self.centred else x

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., 1)``: the norm's divisor ``s(x)`` at stream states ``x (..., E)``, read off the norm itself."""
        if self.norm is None:
            return torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)
        num = (self.gain * self.centre(x)).norm(dim=-1, keepdim=True)
        den = (self.norm(x) - self.bias).norm(dim=-1, keepdim=True)
        return num / den.clamp_min(torch.finfo(x.dtype).tiny)

    def linear(self, part: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The norm with its divisor frozen at ``scale``, without its bias: ``g * P(part) / scale``."""
        return self.gain * self.centre(part) / scale


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _probe_norm(norm: nn.Module | None, E: int, like: torch.Tensor) -> tuple[bool, torch.Tensor, torch.Tensor]:
    if norm is None:
        return False, torch.ones(E, dtype=like.dtype), torch.zeros(E, dtype=like.dtype)
    with torch.no_grad():
        bias = norm(torch.zeros(1, E, dtype=like.dtype, device=like.device))[0]
        u = torch.ones(E, dtype=like.dtype, device=like.device)
        u[1::2] = -1
        if E % 2:
            u[-1] = 0  # zero mean, so centring leaves u as it is
        gain = torch.zeros_like(u)
        for probe in (u, u.roll(1)):  # every feature is +/-1 in one of the two
            r = (probe * probe).mean().sqrt()
            got = (norm(1e3 * probe[None])[0] - bias) * r  # g * probe where probe != 0
            gain = torch.where(probe != 0, got * probe, gain)
        x = like.reshape(-1, E)[:4]
        centred = torch.allclose(norm(x + 3.0), norm(x), atol=1e-4, rtol=1e-3)
    return bool(centred), gain, bias


def readout_of(adapter) -> Readout:
    """The :class:`Readout` of an adapted language model (cached on the adapter); refuses with
    :class:`~headlab.errors.UnsupportedArchitectureError` a model without an output embedding, or one whose
    logits are not ``norm(x_last) @ W_U^T + b_U``."""
    cached = getattr(adapter, "_headlab_readout", None)
    if cached is not None:
        return cached
    model = adapter.model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None and adapter.own_model:
        head = model.tok_emb  # headlab's Transformer ties its unembedding: logits = h @ tok_emb.weight^T
    if head is None or getattr(head, "weight", None) is None:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} has no output embedding (a language-model head): "
            "the logit lens and direct logit attribution need one"
        )
    W_U = head.weight.detach()
    b_U = getattr(head, "bias", None)
    b_U = None if b_U is None or not isinstance(head, nn.Linear) else b_U.detach()
    inside = {id(m) for i in range(adapter.n_layers) for m in adapter.block(i).modules()}
    seen: list[tuple[nn.Module, torch.Tensor | None, torch.Tensor]] = []
    hooks = [
        m.register_forward_hook(lambda mod, a, o: seen.append((mod, _first(a) if a else None, _first(o))))
        for m in model.modules()
        if not list(m.children()) and id(m) not in inside and m is not head
    ]
    recorded: dict[str, torch.Tensor] = {}
    hooks.append(
        adapter.block(adapter.n_layers - 1).register_forward_hook(
            lambda mod, a, o: recorded.__setitem__("x", _first(o))
        )
    )
    ids = torch.tensor([[1, 2, 3]], device=W_U.device)
    try:
        with torch.no_grad():
            out = adapter.forward(ids)
    finally:
        for h in hooks:
            h.remove()
    x = recorded["x"]
    logits = getattr(out, "logits", None)
    norm = None
    for mod, inp, _o in reversed(seen):  # the last module outside the blocks that reads the last block's output
        if isinstance(inp, torch.Tensor) and inp.shape == x.shape and torch.equal(inp, x):
            norm = mod
            break
    centred, gain, bias = _probe_norm(norm, x.shape[-1], x)
    r = Readout(norm, W_U, b_U, centred, gain, bias)
    with torch.no_grad():
        ok = logits is not None and torch.allclose(r.logits(x), logits, atol=1e-4, rtol=1e-4)
        ok = ok and (norm is None or torch.allclose(r.linear(x, r.scale(x)) + bias, norm(x), atol=1e-4, rtol=1e-3))
    if not ok:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__}'s logits are not norm(x) @ W_U^T + b_U of its last block's output x with a "
            "norm g * P(x) / s(x) + b (it scales or caps its logits, or its final norm has another form): "
            "the logit lens and direct logit attribution would misread it"
        )
    adapter._headlab_readout = r
    return r


__all__ = ["Readout", "readout_of"]
