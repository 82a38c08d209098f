"""A pruned model as a :class:`~headlab.models.loader.LoadedModel`: :func:`prune_heads`, ``.save``, reload.

A saved pruned model is a folder holding ``headlab_pruned.json`` (what was kept, per layer, in the
original head indices, and the original config), ``model.safetensors`` and the tokenizer's files;
``headlab.load(folder)`` rebuilds the original architecture, cuts it the same way and loads the
weights. When every layer keeps the same numbers of heads and the family's config can say so
(Llama-style configs carry ``head_dim``), the folder is also a stock Hugging Face folder
(``config.json``) that ``transformers.AutoModelForCausalLM.from_pretrained`` opens. BERT and
GPT-2 configs tie the head size to ``hidden_size / num_heads``, so fewer heads of the same size
cannot be written as a stock config: those folders are headlab's format only (no ``config.json``,
so that stock tools fail clearly instead of loading mismatched shapes).

    >>> import tempfile, torch, headlab
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> m = Transformer(TransformerConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4)).eval()
    >>> p = prune_heads(m, {0: [0, 3]})
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = p.save(d)
    ...     q = headlab.load(d)
    >>> ids = torch.randint(0, 50, (1, 8))
    >>> q.adapter.layer_heads, torch.allclose(p.model(ids).logits, q.model(ids).logits)
    ([2, 4], True)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from headlab.errors import InputError, ModelError
from headlab.models.base import ModelAdapter
from headlab.models.loaded_model import LoadedModel, adapt, resolve
from headlab.models.prune_plan import LayerPlan, LocalPlan
from headlab.models.surgery import PruneResult, apply_plan, prune, pruned_adapter

MANIFEST = "headlab_pruned.json"
WEIGHTS = "model.safetensors"


@dataclass
class PrunedModel(LoadedModel):
    """A physically pruned model. ``plans[l]``: what layer l keeps (original head indices)."""

    plans: list[LayerPlan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    original_heads: tuple[int, int] = (0, 0)  # (H, Hkv) of the unpruned model

    @property
    def kept(self) -> list[tuple[int, ...]]:
        """Live query heads of every layer, in the original indices."""
        return [p.live for p in self.plans]

    @property
    def stock_hf(self) -> bool:
        """Whether :meth:`save` also writes a stock Hugging Face folder (every layer alike, and a family
        whose config can say the counts: ``stock_config``)."""
        return (
            bool(getattr(self.adapter, "stock_config", False)) and len({(len(p.q), len(p.kv)) for p in self.plans}) == 1
        )

    def save(self, path: str | os.PathLike, *, force: bool = False) -> Path:
        """Write the folder (see the module docstring); refuses a non-empty folder unless ``force``."""
        from safetensors.torch import save_model

        path = Path(path)
        if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not force)):
            raise InputError(f"{path} exists and is not an empty folder; choose a new one or pass force=True")
        path.mkdir(parents=True, exist_ok=True)
        base = "headlab" if self.adapter.own_model else "hf"
        cfg = self.model.config.to_dict()
        if base == "hf":
            cfg.pop("_attn_implementation_autoset", None)
        manifest = {
            "format": 1,
            "family": self.family,
            "base": base,
            "source": self.name,
            "original_heads": list(self.original_heads),
            "config": cfg,
            "class": type(self.model).__name__,
            "stock_hf": self.stock_hf,
            "plans": [{"q": list(p.q), "kv": list(p.kv), "zeroed": list(p.zeroed)} for p in self.plans],
            "notes": self.notes,
        }
        if self.stock_hf:
            import transformers

            bar = transformers.logging.is_progress_bar_enabled()
            transformers.logging.disable_progress_bar()
            try:
                self.model.save_pretrained(path)  # config.json + model.safetensors, loadable by stock transformers
            finally:
                if bar:
                    transformers.logging.enable_progress_bar()
        else:
            save_model(self.model, str(path / WEIGHTS))
        (path / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)
        return path


def _original_heads(adapter: ModelAdapter, loaded) -> tuple[int, int]:
    if isinstance(loaded, PrunedModel):
        return loaded.original_heads
    return adapter.n_heads, adapter.n_kv_heads


def prune_heads(loaded, heads: dict, *, allow_empty_layers: bool = False, gqa: str = "pad") -> PrunedModel:
    """A new, physically smaller model without ``heads`` ``{layer: [head, ...]}``; the input is untouched.

    Args:
        loaded: a :class:`LoadedModel` (``headlab.load``), a model or an adapter.
        heads: heads to remove, in the input's current indices.
        allow_empty_layers: allow removing every head of a layer (it then outputs W^O's bias only).
        gqa: ``"pad"`` (keep groups even with zero-output heads, say so in ``notes``) or ``"strict"``.

    On a model sharded by tensor parallelism every rank calls this alike and gets its shard of the pruned model
    (see :mod:`headlab.models.surgery`).

    Raises:
        ConfigError: a layer or head out of range. PruneError: a whole layer without the flag, uneven GQA groups
        with ``gqa="strict"``, or (sharded) a removal that would leave the ranks holding unequal heads.
    """
    adapter, ld = resolve(loaded)
    r: PruneResult = prune(adapter, heads, allow_empty_layers=allow_empty_layers, gqa=gqa)  # type: ignore[arg-type]  # checked by prune
    _check_own_math(adapter, r, heads)
    name = ld.name if ld is not None else type(adapter.model).__name__
    max_pos = ld.max_positions if ld is not None else _max_positions(r.model)
    tok = ld.tokenizer if ld is not None else None
    notes = [*(ld.notes if isinstance(ld, PrunedModel) else []), *r.notes]
    return PrunedModel(
        r.model,
        tok,
        r.adapter,
        f"{name} (pruned)",
        adapter.family,
        max_pos,
        plans=r.plans,
        notes=notes,
        original_heads=_original_heads(adapter, ld),
    )


def _check_own_math(adapter, r: PruneResult, heads: dict) -> None:
    """A model whose modules compute attention with their own math may read a width from somewhere headlab did not
    change (nanoGPT's ``C // n_head`` from the input's width): the pruned copy must equal the gated original on a
    few tokens, else the removal is refused (gates still serve). So must a model adapted by structure, whose attention
    module may hold per-head parameters headlab does not slice (wav2vec2-conformer's ``pos_bias_u``/``linear_pos``)."""
    from headlab.models.hf.own_state import bridge_of

    own = bridge_of(adapter.model) is not None
    if not own and not getattr(adapter, "by_structure", False):
        return
    from headlab.errors import PruneError
    from headlab.models.inputs import example_inputs

    x = example_inputs(adapter.model, tokens=6)
    saved = adapter.gates.detach().clone()
    try:
        for layer, hs in heads.items():
            adapter.gates[int(layer), list(hs)] = 0.0
        with torch.no_grad():
            want = _first(adapter.model(**x))
        try:
            with torch.no_grad():
                got = _first(r.model(**x))
            why = (
                ""
                if got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=1e-4)
                else ("the pruned copy's output differs from the gated model's")
            )
        except Exception as e:  # noqa: BLE001  (the module's own forward fails on the new widths)
            why = f"the pruned copy fails ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    finally:
        adapter.gates = saved
    if why:
        raise PruneError(
            f"{type(adapter.attn_modules[0]).__name__} "
            + ("computes attention with its own math and " if own else "(adapted by structure) ")
            + f"reads a head count or width headlab cannot change: {why}; gate the heads instead (adapter.gates), or "
            "declare the module's head attributes in a family class"
        )


def _first(out) -> torch.Tensor:
    t = getattr(out, "logits", None)
    t = t if t is not None else getattr(out, "last_hidden_state", None)
    return t if t is not None else (out[0] if isinstance(out, tuple | list) else out)


def _max_positions(model: Any) -> int:  # a transformers model or headlab's Transformer
    cfg = model.config
    if hasattr(cfg, "max_positions"):
        return int(cfg.max_positions)
    from headlab.models.hf import max_positions

    return max_positions(cfg)


def load_pruned(
    path: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> PrunedModel:
    """Read a folder written by :meth:`PrunedModel.save` (``headlab.load`` calls this)."""
    from safetensors.torch import load_model

    path = Path(path)
    try:
        man = json.loads((path / MANIFEST).read_text())
        plans = [LayerPlan(q=tuple(p["q"]), kv=tuple(p["kv"]), zeroed=tuple(p["zeroed"])) for p in man["plans"]]
        H, Hkv = man["original_heads"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"{path / MANIFEST} is not a headlab pruning manifest: {e}") from None
    cfg = dict(man["config"])
    if man["base"] == "headlab":
        from headlab.models.transformer import Transformer, TransformerConfig

        cfg.pop("model_type", None)
        model = Transformer(TransformerConfig.from_dict(cfg))
        max_pos = model.config.max_positions
    else:
        model, max_pos = _build_hf(cfg, H, Hkv, man.get("class"))
    model = model.to(dtype).eval()
    template = adapt(model)
    attn, outs = template.attn_modules, template.out_projs
    template.close()
    local = [LocalPlan(p) for p in plans]
    apply_plan(template, local, attn, outs, [(H, Hkv)] * template.n_layers)
    if man.get("stock_hf"):
        template.prune_config(model.config, len(plans[0].q), len(plans[0].kv))
    adapter = pruned_adapter(template, model, local, plans, attn, outs)
    weights = path / WEIGHTS
    if not weights.is_file():
        raise ModelError(f"{path} has a pruning manifest but no {WEIGHTS}")
    missing, unexpected = load_model(model, str(weights), strict=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # type: ignore[operator]  # torch types module attributes Tensor | Module
    tied = {n for n, _ in model.named_parameters()}  # what remains missing after tying is real
    real_missing = [m for m in missing if m in tied and not _is_tied(model, m)]
    if real_missing or unexpected:
        raise ModelError(
            f"{weights} does not match its manifest: missing {real_missing[:5]}, unexpected {unexpected[:5]}"
        )
    for layer, p in enumerate(plans):
        adapter.gates[layer, [i for i, h in enumerate(p.q) if h in p.zeroed]] = 0.0
    model = model.to(device)
    tokenizer = _tokenizer(path)
    return PrunedModel(
        model,
        tokenizer,
        adapter,
        str(path),
        man["family"],
        max_pos,
        plans=plans,
        notes=list(man.get("notes", [])),
        original_heads=(H, Hkv),
    )


def _is_tied(model: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` is the same tensor as another parameter (tied embeddings)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    t = params.get(name)
    return t is not None and any(o is t for n, o in params.items() if n != name)


def _build_hf(cfg: dict, H: int, Hkv: int, class_name: str | None):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoConfig

    from headlab.models.hf import max_positions

    model_type = cfg.pop("model_type")
    if "num_key_value_heads" in cfg:
        cfg["num_key_value_heads"] = Hkv
    cfg["num_attention_heads"] = H
    config = AutoConfig.for_model(model_type, **cfg)
    arch = class_name or (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        cls = transformers.AutoModel
        model = cls.from_config(config, attn_implementation="eager")
    else:
        model = cls._from_config(config, attn_implementation="eager")
    return model, max_positions(config)


def _tokenizer(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001  (the tokenizer's loaders raise many kinds: said as a ModelError)
        raise ModelError(f"{path} has tokenizer files that transformers cannot read: {e}") from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok
