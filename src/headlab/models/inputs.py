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


def feature_bins(model: nn.Module) -> int:
    """Features per frame of an ``input_features`` model: its mel bins (Whisper, Parakeet, LASR), or Speech2Text's
    ``input_feat_per_channel x input_channels``, or a ``feature_size``."""
    for cfg in _configs(model):
        for name in ("num_mel_bins", "feature_size"):
            if getattr(cfg, name, None):
                return int(getattr(cfg, name))
        if getattr(cfg, "input_feat_per_channel", None):
            return int(cfg.input_feat_per_channel) * int(getattr(cfg, "input_channels", 1) or 1)
    return 80


def _configs(model: nn.Module) -> list:
    """The model's config and the encoder's nested one (a CTC head over an encoder keeps its sizes there)."""
    cfg = model.config
    inner = getattr(cfg, "encoder_config", None)
    return [cfg] if inner is None or isinstance(inner, dict) else [cfg, inner]


def features_layout(model: nn.Module) -> str:
    """How an ``input_features`` model lays out a batch: ``"channels_first"`` ``(B, mel, frames)`` where its first
    layer is a Conv1d over the mel bins as channels (Whisper and its kin), else ``"time_major"`` ``(B, frames, mel)``
    (Speech2Text, Parakeet, LASR and other conformers: a linear or 2-D convolutional front end over time x mel)."""
    mel = next((c.num_mel_bins for c in _configs(model) if getattr(c, "num_mel_bins", None)), None)
    first = next((m for m in model.modules() if isinstance(m, nn.Conv1d | nn.Conv2d | nn.Linear)), None)
    if mel and isinstance(first, nn.Conv1d) and first.in_channels == int(mel):
        return "channels_first"
    return "time_major"


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
        mel = feature_bins(model)
        if features_layout(model) == "channels_first":  # Whisper: (B, mel, frames), conv stride 2 over a fixed length
            frames = 2 * int(getattr(cfg, "max_source_positions", tokens))
            out[kind] = torch.randn(batch, mel, frames, generator=g)
        else:  # (B, frames, mel): about ``tokens`` positions after a 4x subsampling front end
            out[kind] = torch.randn(batch, 4 * tokens + 8, mel, generator=g)
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


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's token embedding, or None where it has none (audio models: transformers raises
    NotImplementedError from ``get_input_embeddings``)."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        return get() if get is not None else None
    except (NotImplementedError, AttributeError):
        return None


def has_lm_head(model: nn.Module) -> bool:
    """Does the model end in output embeddings (a language-model head, whatever its class is called)?"""
    get = getattr(model, "get_output_embeddings", None)
    try:
        return get is not None and get() is not None
    except (NotImplementedError, AttributeError):
        return False


# token inputs of a batch that may differ in length, each with the value a padded position takes
_PADDED = {
    "input_ids": None,
    "decoder_input_ids": None,
    "token_type_ids": 0,
    "labels": -100,
    "attention_mask": 0,
    "decoder_attention_mask": 0,
}
_MASK_OF = {"input_ids": "attention_mask", "decoder_input_ids": "decoder_attention_mask"}


def stack_examples(model: nn.Module, examples: list) -> dict[str, torch.Tensor]:
    """One batch from examples given as dicts of tensors (each a batch of its own, usually of one).

    Token inputs of different lengths (``input_ids``, ``decoder_input_ids``, ``token_type_ids``, ``labels``) are
    right-padded to the longest, with the model's ``pad_token_id`` (labels with -100, which losses ignore), and
    their masks (``attention_mask``, ``decoder_attention_mask``) padded with 0, or made when the examples gave
    none: what a tokenizer does to texts of different lengths. Any other input that differs in shape (pixels,
    audio of different lengths) is an :class:`~headlab.errors.InputError`: padding it would change what the
    model computes unless the feature extractor's own mask comes with it."""
    keys = list(examples[0])
    for i, t in enumerate(examples):
        if sorted(t) != sorted(keys):
            raise InputError(
                f"example {i} gives the inputs {', '.join(sorted(t))} but example 0 gives {', '.join(sorted(keys))}; "
                "every example of a batch needs the same inputs"
            )
    vals = {k: [torch.as_tensor(t[k]) for t in examples] for k in keys}
    for ids, mask in _MASK_OF.items():
        if ids in vals and mask not in vals and len({tuple(v.shape) for v in vals[ids]}) > 1:
            vals[mask] = [torch.ones(v.shape[:2], dtype=torch.long, device=v.device) for v in vals[ids]]
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    out = {}
    for k, ts in vals.items():
        shapes = [tuple(v.shape) for v in ts]
        if len({s[1:] for s in shapes}) == 1:
            out[k] = torch.cat(ts)
            continue
        if k not in _PADDED or any(len(s) != 2 for s in shapes):
            a = next(i for i, s in enumerate(shapes) if s[1:] != shapes[0][1:])
            raise InputError(
                f"examples 0 and {a} give {k!r} of shapes {shapes[0]} and {shapes[a]}: a batch holds one shape of "
                f"{k!r}; give examples of equal shape (pad them as the feature extractor does, with its "
                "attention_mask), or batch_size=1"
            )
        fill = _PADDED[k] if _PADDED[k] is not None else int(pad_id if isinstance(pad_id, int) else 0)
        n = max(s[1] for s in shapes)
        out[k] = torch.cat([torch.nn.functional.pad(v, (0, n - v.shape[1]), value=fill) for v in ts])
    return out


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
    if not is_encoder_decoder(model) or {"decoder_input_ids", "decoder_inputs_embeds", "labels"} & set(inputs):
        return inputs  # decoder inputs given, or labels the model shifts right into them itself
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


__all__ = [
    "KINDS",
    "complete_inputs",
    "example_inputs",
    "feature_bins",
    "features_layout",
    "has_lm_head",
    "input_embeddings",
    "input_kind",
    "is_encoder_decoder",
    "stack_examples",
]
