"""The inputs a model takes, read from its structure: :func:`input_kind` and :func:`example_inputs`.

Hugging Face models name their main input (``main_input_name``): token ids (``input_ids``), image
patches (``pixel_values``), log-mel features (``input_features``, Whisper) or raw waveforms
(``input_values``, wav2vec2, HuBERT); an encoder-decoder also takes ``decoder_input_ids``. headlab's
analyses take a batch as a dict of those tensors; :func:`example_inputs` builds a small one from the
config alone (what the load-time check runs on), and :func:`complete_inputs` adds the decoder inputs an
encoder-decoder needs when only the encoder's were given (the encoder's ids shifted right, teacher-forced).

    >>> import torch, transformers as T
    >>> m = T.ViTModel(T.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
    ...                            intermediate_size=64, image_size=16, patch_size=4))
    >>> input_kind(m), tuple(example_inputs(m)["pixel_values"].shape)
    ('pixel_values', (1, 3, 16, 16))
"""

from __future__ import annotations

import torch
from torch import nn

from headlab.errors import InputError

KINDS = ("input_ids", "pixel_values", "input_features", "input_values")


def input_kind(model: nn.Module) -> str:
    """The model's main input: one of :data:`KINDS` (``input_ids`` for models that do not say)."""
    name = getattr(model, "main_input_name", "input_ids")
    return name if name in KINDS else "input_ids"


def is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def _side(v) -> int:
    return int(v[0] if isinstance(v, list | tuple) else v)


def _wave_length(cfg, frames: int) -> int:
    """Samples a convolutional front end (wav2vec2, HuBERT) turns into ``frames`` frames."""
    n = frames
    for k, s in reversed(list(zip(cfg.conv_kernel, cfg.conv_stride))):
        n = (n - 1) * s + k
    return n


def example_inputs(model: nn.Module, *, tokens: int = 8, batch: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small batch the model takes, from its config alone (random ids or features, a fixed seed).

    Args:
        tokens: sequence length for token inputs (and about the frames of an audio input); image inputs
            take the config's image size, Whisper its fixed number of frames.
    """
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    p = next(model.parameters(), None)
    device = p.device if p is not None else None
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    kind = input_kind(model)
    vocab = getattr(cfg, "vocab_size", None) or 100
    lo = min(3, vocab - 1)  # keep clear of the low special ids (padding, start, end) where the vocabulary allows
    out: dict[str, torch.Tensor] = {}
    if kind == "pixel_values":
        side = _side(getattr(cfg, "image_size", 224))
        ch = int(getattr(cfg, "num_channels", 3))
        out[kind] = torch.randn(batch, ch, side, side, generator=g)
    elif kind == "input_features":
        mel = int(getattr(cfg, "num_mel_bins", 80))
        frames = 2 * int(getattr(cfg, "max_source_positions", tokens))  # Whisper's conv stride 2 over a fixed length
        out[kind] = torch.randn(batch, mel, frames, generator=g)
    elif kind == "input_values":
        n = _wave_length(cfg, tokens) if hasattr(cfg, "conv_kernel") else 16000
        out[kind] = torch.randn(batch, n, generator=g)
    else:
        out["input_ids"] = torch.randint(lo, vocab, (batch, tokens), generator=g)
        out["attention_mask"] = torch.ones(batch, tokens, dtype=torch.long)
    if is_encoder_decoder(model):
        dvocab = getattr(cfg, "decoder_vocab_size", None) or vocab
        out["decoder_input_ids"] = torch.randint(min(3, dvocab - 1), dvocab, (batch, max(2, tokens - 3)), generator=g)
    return {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)) for k, v in out.items()}


def has_lm_head(model: nn.Module) -> bool:
    """Does the model end in output embeddings (a language-model head, whatever its class is called)?"""
    get = getattr(model, "get_output_embeddings", None)
    try:
        return get is not None and get() is not None
    except (NotImplementedError, AttributeError):
        return False


def complete_inputs(model: nn.Module, inputs: dict) -> dict:
    """``inputs`` with what the model still needs to run: an encoder-decoder given encoder ids only gets
    ``decoder_input_ids`` = the ids shifted right after ``decoder_start_token_id`` (teacher forcing on the
    input itself, what ``labels=input_ids`` would build). A model that takes no token ids given token ids is
    an :class:`~headlab.errors.InputError` naming the input it takes."""
    kind = input_kind(model)
    if kind != "input_ids" and kind not in inputs:
        given = ", ".join(sorted(inputs)) or "nothing"
        raise InputError(
            f"{type(model).__name__} takes {kind!r} (an {'image' if kind == 'pixel_values' else 'audio'} "
            f"batch), got {given}; pass a dict {{'{kind}': tensor}} per example "
            "(headlab.models.inputs.example_inputs(model) shows the shape)"
        )
    if not is_encoder_decoder(model) or "decoder_input_ids" in inputs or "decoder_inputs_embeds" in inputs:
        return inputs
    ids = inputs.get("input_ids")
    if ids is None:
        raise InputError(
            f"{type(model).__name__} is an encoder-decoder: give 'decoder_input_ids' beside {', '.join(sorted(inputs))}"
        )
    cfg = model.config
    start = getattr(cfg, "decoder_start_token_id", None)
    if start is None:
        start = getattr(cfg, "bos_token_id", None) or 0
    pad = getattr(cfg, "pad_token_id", None) or 0
    dec = torch.cat([torch.full_like(ids[:, :1], int(start)), ids[:, :-1]], dim=1)
    dec = dec.masked_fill(dec < 0, int(pad))
    return {**inputs, "decoder_input_ids": dec}


__all__ = ["KINDS", "complete_inputs", "example_inputs", "has_lm_head", "input_kind", "is_encoder_decoder"]
