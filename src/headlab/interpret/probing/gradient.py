"""The gradient ("no-op") test of the probe (Clark et al. 2019, figure 3): ``|d loss / d attention|`` on the
attention to [SEP] (a decoder's first token) against all other attention, per head.

:func:`resolve_loss_model` picks the model whose loss is differentiated (the probed model's own LM or
classification loss, or another model of the same heads); :func:`gradient_batch` gives one batch's sums, which
:class:`~headlab.interpret.probing.head_scores.ProbeRun` keeps as one unit each and adds in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from headlab.errors import ModelError
from headlab.interpret.capture import capture
from headlab.interpret.probing import align as al
from headlab.interpret.probing.measures import grad_sums

if TYPE_CHECKING:
    from headlab.models.loader import LoadedModel

GRADS = ("grad_sep", "grad_other", "grad_first")  # the per-head measures, in the order of the sums


def loss_kind(model) -> str | None:
    """``"causal-lm"``, ``"masked-lm"``, ``"classifier"`` or None (no head that defines a loss), by class name."""
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")) or name == "Transformer":
        return "causal-lm"
    if name.endswith(("ForMaskedLM", "ForPreTraining")):
        return "masked-lm"
    if name.endswith("ForSequenceClassification"):
        return "classifier"
    return None


def resolve_loss_model(loaded, loss_model) -> tuple[LoadedModel | None, str]:
    """The model whose loss the gradient test differentiates, and a sentence saying which loss."""
    from headlab.models.cache import cache_dir
    from headlab.models.loader import LoadedModel, load

    if loss_model is None:
        return None, "gradient test not run (loss_model=None)"
    if loss_model == "auto":
        if loss_kind(loaded.model) is not None:
            chosen = loaded
        else:
            sst2 = cache_dir("minilm-sst2")
            if loaded.name == "minilm" and (sst2 / "config.json").is_file():
                chosen = load(sst2)
            else:
                return None, (
                    f"gradient test not run: {loaded.name} ({type(loaded.model).__name__}) has no head that "
                    "defines a loss (no LM or classification head); pass loss_model= a model of the same "
                    "shape that has one, e.g. the fine-tuned SST-2 classifier"
                )
    elif isinstance(loss_model, LoadedModel):
        chosen = loss_model
    else:
        chosen = load(loss_model)
    kind = loss_kind(chosen.model)
    if kind is None:
        raise ModelError(
            f"loss_model {chosen.name} ({type(chosen.model).__name__}) has no LM or classification head, "
            "so it defines no loss to differentiate"
        )
    if chosen.adapter.layer_heads != loaded.adapter.layer_heads:
        raise ModelError(
            f"loss_model {chosen.name} has heads per layer {chosen.adapter.layer_heads}, "
            f"the probed model {loaded.adapter.layer_heads}; they must match"
        )
    what = {
        "causal-lm": "next-token cross-entropy (the model's own LM loss)",
        "masked-lm": "masked-LM cross-entropy of every token, no token masked",
        "classifier": "cross-entropy of the classifier against its own predicted label (the treebank has no "
        "labels for its task)",
    }[kind]
    return chosen, f"d loss / d attention from {chosen.name}: {what}"


def _loss_fn(kind: str, ids: torch.Tensor, mask: torch.Tensor):
    def scalar(out):
        logits = out.logits.float()
        if kind == "classifier":
            return torch.nn.functional.cross_entropy(logits, logits.argmax(-1).detach(), reduction="sum")
        if kind == "causal-lm":
            logits, target, m = logits[:, :-1], ids[:, 1:], mask[:, 1:].float()
        else:
            target, m = ids, mask.float()
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # (B, T)
        return ((ce * m).sum(1) / m.sum(1).clamp(min=1)).sum()  # each sentence's mean, summed

    return scalar


def gradient_batch(chosen, group, causal: bool, backend) -> tuple[list[torch.Tensor], list[float]]:
    """One batch of the gradient test: the ``|d loss / d attention|`` sums ``[sink, other, first] (K,)`` float64
    and their counts. Only d loss / d attention is wanted: the weights get no gradient while it runs."""
    kind = loss_kind(chosen.model)
    assert kind is not None  # resolve_loss_model chose a model with a loss
    L = chosen.adapter.n_layers
    pad = chosen.tokenizer.pad_token_id if chosen.tokenizer.pad_token_id is not None else 0
    b = al.make_batch(group, {}, pad)
    params = [p for p in chosen.model.parameters() if p.requires_grad]
    for p in params:  # no weight gradients (half the backward)
        p.requires_grad_(False)
    try:
        cache = capture(
            chosen,
            {"input_ids": b.input_ids, "attention_mask": b.attention_mask},
            chosen.adapter.sites("pattern"),
            grads=True,
            scalar=_loss_fn(kind, b.input_ids, b.attention_mask),
            backend=backend,
        )
    finally:
        for p in params:
            p.requires_grad_(True)
    g = torch.cat([cache.grads[chosen.adapter.site_name(i, "pattern")] for i in range(L)], dim=1)  # (B, K, T, T)
    valid = b.attention_mask.bool()
    sink = b.sep.clone() if not causal else torch.zeros_like(valid)
    if causal or not sink.any():  # decoders (and encoders without [SEP]): the first token is the sink
        sink[:, 0] = True
    s_sink, n_sink, s_other, n_other = grad_sums(g, valid, sink, causal=causal)
    first = torch.zeros_like(valid)
    first[:, 0] = True  # [CLS] (an encoder's other sink) or a decoder's first token
    s_first, n_first, _, _ = grad_sums(g, valid, first, causal=causal)
    return [s_sink, s_other, s_first], [n_sink, n_other, n_first]


__all__ = ["GRADS", "gradient_batch", "loss_kind", "resolve_loss_model"]
