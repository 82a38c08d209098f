"""How far a loaded model's final hidden states move when every attention layer runs an efficient variant:
:func:`compare_model` (the same variants as :func:`headlab.interpret.fidelity.approx.compare`, on a real model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headlab.errors import ConfigError
from headlab.interpret.fidelity.approx import backend_label, resolve_backend

__all__ = ["ModelShift", "compare_model"]


@dataclass
class ModelShift:
    """How far a model's final hidden states move when every attention layer runs ``backend``."""

    backend: str
    tokens: int
    rel_error: float  # ||h_variant - h_exact|| / ||h_exact|| over all positions
    cosine_mean: float  # mean over positions of the cosine between the two hidden states
    cosine_min: float
    rel_error_per_position: list[float]

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def compare_model(loaded, text_or_inputs, backend) -> ModelShift:
    """Swap ``backend`` into every attention layer of ``loaded`` and compare final hidden states.

    Args:
        loaded: a :class:`headlab.models.LoadedModel` (from :func:`headlab.load`).
        text_or_inputs: a string (tokenised by ``loaded.encode``) or model inputs (the dict
            ``loaded.encode`` returns, or an ``input_ids`` tensor ``(B, L)``).
        backend: as for :func:`compare` (``"linear"``, ``"favor:256"``, a backend object ...).

    Returns:
        a :class:`ModelShift`: relative error and cosine of the last hidden states over the real
        tokens. A padded batch (``attention_mask`` with zeros) is run one unpadded row at a time.
    """
    be = resolve_backend(backend)
    inputs = loaded.encode(text_or_inputs) if isinstance(text_or_inputs, str) else text_or_inputs
    exact, variant = [], []
    with torch.no_grad():
        for one in _unpadded(inputs):
            exact.append(_flat(_last_hidden(loaded(one))))
            with loaded.adapter.use_backend(be):
                variant.append(_flat(_last_hidden(loaded(one))))
    e, a = torch.cat(exact).double(), torch.cat(variant).double()  # (real tokens, E)
    cos = (e * a).sum(-1) / (e.norm(dim=-1) * a.norm(dim=-1)).clamp_min(1e-300)
    per_pos = (a - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-300)
    return ModelShift(
        backend=backend_label(be),
        tokens=int(e.shape[0]),
        rel_error=float((a - e).norm() / e.norm()),
        cosine_mean=float(cos.mean()),
        cosine_min=float(cos.min()),
        rel_error_per_position=per_pos.tolist(),
    )


def _flat(h: torch.Tensor) -> torch.Tensor:
    return h.reshape(-1, h.shape[-1])  # (B * L, E)


def _unpadded(inputs):
    """A padded batch as one unpadded input per row: padding positions are not compared, and the
    model needs no padding mask (which Hugging Face materialises per query, and linear attention
    cannot take)."""
    if (
        isinstance(inputs, dict)
        and isinstance(inputs.get("attention_mask"), torch.Tensor)
        and inputs["attention_mask"].dim() == 2
    ):
        keep = inputs["attention_mask"].bool()
        for b in range(keep.shape[0]):
            n = int(keep[b].sum())
            if not bool(keep[b, :n].all()):
                raise ConfigError("compare_model expects right padding (real tokens first in every row)")
            yield {
                name: t[b : b + 1, :n]
                for name, t in inputs.items()
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape == keep.shape
            }
    else:
        yield inputs


def _last_hidden(output) -> torch.Tensor:
    for name in ("last_hidden_state", "hidden"):
        h = getattr(output, name, None)
        if isinstance(h, torch.Tensor):
            return h
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("last_hidden_state"), torch.Tensor):
        return output["last_hidden_state"]
    raise ConfigError(f"cannot find final hidden states in the model output of type {type(output).__name__}")
