"""Running a stock Hugging Face model on a headlab backend, through transformers' ``AttentionInterface``.

Importing this module registers one attention implementation, ``"headlab"``, in transformers v5:

- ``AttentionInterface["headlab"]`` = :func:`headlab_attention_forward`, called by every supported
  attention module exactly like ``sdpa_attention_forward``: ``(module, query (B, H, Lq, d),
  key (B, Hkv, Lk, d), value, attention_mask, dropout=, scaling=, **kwargs)``, returning
  ``(out (B, Lq, H, d), weights or None)``;
- ``AttentionMaskInterface["headlab"]`` = transformers' ``sdpa_mask``: the model builds a boolean
  ``(B, 1, Lq, Lk)`` mask (True = may attend), or None when the pattern is plain causal or full,
  in which case the module's ``is_causal`` decides, as for SDPA.

A cache may hand the function, in place of its key tensor, a key object that attends itself
(:class:`SelfAttendingKeys`: keys held in a form of its own, such as ``headlab.decode.HeadCache``'s per-head
groups); the function then calls its ``headlab_attend`` and does nothing else. The protocol lives here, with the
function that calls it, so a cache implements it and this module knows no cache.

The model switches to it by setting ``config._attn_implementation = "headlab"`` (which is what
:meth:`ModelAdapter.use_backend` does, and undoes). Which headlab backend serves each layer is kept
on the module (:class:`~headlab.models.base.LayerState`), so two models can run on different backends.

Conventions kept from Hugging Face: the module's ``scaling`` (GPT-2's per-layer scaling included),
dropout only when the module is training, grouped-query heads read without copying K/V (query head h
reads kv head ``h // (H // Hkv)``, the layout of ``repeat_kv``). Additive float masks (what the
eager path builds, or a user's 4-D mask) are converted to boolean: 0 = may attend, the dtype's minimum
or ``-inf`` = may not; any other finite value is an additive bias that the model passes in the mask (BEiT's
and Data2Vec's relative position bias), added to the scores as a score_mod (``headlab.masks.bias_tensor``).
Gemma 2's ``softcap`` (``attn_logit_softcapping``) becomes the score_mod ``headlab.masks.softcap(c)``,
which the reference, tiled and sparse backends apply (``auto`` then picks tiled: sdpa cannot).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from headlab.errors import BackendUnsupportedError, MaskError
from headlab.models.sites import run_attention
from headlab.spec.score_mods import bias_tensor, softcap

IMPLEMENTATION = "headlab"


@runtime_checkable
class SelfAttendingKeys(Protocol):
    """A key object that attends itself: what a cache's ``update`` may return in place of the key tensor, so that
    :func:`headlab_attention_forward` hands it the queries instead of attending to keys itself.

    ``headlab_attend(module, query (B, H, Lq, d), attention_mask, *, scaling, softcap=None)`` returns ``(out
    (B, Lq, H, dv), None)``, as an attention function does. ``attention_mask``: the model's own mask (boolean or
    additive, ``(B, 1, Lq, Lk)``) or None for plain causal; ``softcap``: Gemma 2's tanh soft-capping of the scores."""

    def headlab_attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        scaling: float | None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, None]: ...


def hf_mask_to_bool(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A Hugging Face attention mask as a headlab boolean mask (True = may attend).

    Args:
        mask: None; boolean ``(B, 1|H, Lq, Lk)`` (True = may attend, what ``sdpa_mask`` builds); or an
            additive float mask of that shape (0 = may attend, ``finfo.min`` / ``-inf`` = may not).

        >>> import torch
        >>> m = torch.tensor([[[[0.0, torch.finfo(torch.float32).min]]]])
        >>> hf_mask_to_bool(m)
        tensor([[[[ True, False]]]])
    """
    if mask is None or mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise MaskError(
            f"attention mask of dtype {mask.dtype}: expected a boolean mask (True = may attend) or an additive float mask (0 or -inf)"
        )
    blocked = mask <= torch.finfo(mask.dtype).min / 2  # finfo.min and -inf
    if bool(((mask != 0) & ~blocked).any()):
        raise BackendUnsupportedError(
            "the attention mask carries an additive bias (values other than 0 and -inf); headlab backends take "
            "boolean masks only: run this model with attn_implementation='eager' instead of a headlab backend"
        )
    return ~blocked


def hf_mask_and_bias(mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(boolean mask or None, additive bias or None)`` from a Hugging Face attention mask: a float mask whose
    finite entries are not all 0 carries a bias (a relative position bias passed as the mask).

        >>> import torch
        >>> m = torch.tensor([[[[0.5, float("-inf")]]]])
        >>> hf_mask_and_bias(m)
        (tensor([[[[ True, False]]]]), tensor([[[[0.5000, 0.0000]]]]))
    """
    if mask is None or mask.dtype == torch.bool or not mask.is_floating_point():
        return hf_mask_to_bool(mask), None
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(((mask != 0) & ~blocked).any()):
        return ~blocked, None
    return (None if not bool(blocked.any()) else ~blocked), mask.masked_fill(blocked, 0.0)


def _then(first, second, name):
    """Two score modifications applied in turn (soft-capping, then an additive bias)."""
    from headlab.spec.score_mods import ScoreMod

    return ScoreMod(lambda s, b, h, q, kv: second(first(s, b, h, q, kv), b, h, q, kv), name)


def headlab_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function registered as ``"headlab"``; same calling convention as transformers' SDPA one.

    Returns ``(out (B, Lq, H, d), weights (B, H, Lq, Lk) or None)``; the weights are computed when the
    caller asks for ``output_attentions`` or a capture asks for this layer's pattern.
    """
    attend = None if isinstance(key, torch.Tensor) else getattr(key, "headlab_attend", None)
    if attend is not None:  # a key object that attends itself (SelfAttendingKeys; the protocol's check is slower)
        return attend(module, query, attention_mask, scaling=scaling, softcap=kwargs.get("softcap"))
    if kwargs.get("s_aux") is not None:
        raise BackendUnsupportedError(
            f"{type(module).__name__} passes 's_aux' (attention sinks) to its attention function, which headlab "
            "backends do not implement; run this model with attn_implementation='eager'"
        )
    q_len = query.shape[2]
    mask, mask_bias = hf_mask_and_bias(attention_mask)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # as in transformers' SDPA path: a missing mask means "plain causal" for a causal module
    causal = bool(q_len > 1 and mask is None and mask_bias is None and is_causal)
    if causal and key.shape[2] > q_len:  # prefill into an empty static cache: drop the unused slots
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    # Gemma 2's tanh soft-capping of the scores, as a FlexAttention-style score_mod (reference, tiled, sparse)
    cap = kwargs.get("softcap")
    extra = {"score_mod": softcap(cap)} if cap is not None else None
    bias = kwargs.get("position_bias")  # T5's relative bias (1 or B, H, Lq, Lk), computed by the stack's first layer
    if bias is not None and bool(bias.any()):
        kept = getattr(module, "_headlab_bias_heads", None)  # a pruned layer: the rows of the heads it kept
        extra = {"score_mod": bias_tensor(bias if kept is None else bias[:, kept], "relative_bias")}
    if mask_bias is not None:  # a bias the model passes in its mask (BEiT's relative position bias)
        kept = getattr(module, "_headlab_bias_heads", None)
        if kept is not None and mask_bias.shape[1] > 1:
            mask_bias = mask_bias[:, kept]
        add = bias_tensor(mask_bias, "mask_bias")
        extra = {"score_mod": add if extra is None else _then(extra["score_mod"], add, "score_mod+mask_bias")}
    out, weights = run_attention(
        module,
        query,
        key,
        value,
        mask,
        causal=causal,
        scale=scaling,
        dropout_p=dropout,
        need_weights=bool(kwargs.get("output_attentions", False)),
        score_kwargs=extra,
    )  # out: (B, H, Lq, d)
    return out.transpose(1, 2).contiguous(), weights  # (B, Lq, H, d)


AttentionInterface.register(IMPLEMENTATION, headlab_attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
