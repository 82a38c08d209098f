"""Real models, one view: adapters for Hugging Face families and headlab's own transformer.

    headlab.load("minilm")        -> LoadedModel (model, tokenizer, adapter), offline
    headlab.models.adapt(model)   -> ModelAdapter for a model you built

Families: BERT-style encoders (bert, roberta; MiniLM is a BertModel), GPT-2, Llama-style decoders
with grouped-query attention (llama, mistral, qwen2), and :class:`~headlab.models.transformer.Transformer`.
Names load lazily so that ``import headlab.models`` does not import transformers.
"""

from importlib import import_module as _import_module

__all__ = [
    "KNOWN_MODELS",
    "LoadedModel",
    "ModelAdapter",
    "Transformer",
    "TransformerConfig",
    "TruncationWarning",
    "adapt",
    "cache_dir",
    "load",
]

_LAZY = {
    "load": "headlab.models.loader",
    "adapt": "headlab.models.loaded_model",
    "LoadedModel": "headlab.models.loaded_model",
    "KNOWN_MODELS": "headlab.models.loader",
    "TruncationWarning": "headlab.models.loaded_model",
    "ModelAdapter": "headlab.models.base",
    "cache_dir": "headlab.models.cache",
    "Transformer": "headlab.models.transformer",
    "TransformerConfig": "headlab.models.transformer",
}


def __getattr__(name: str):
    if name in _LAZY:
        obj = getattr(_import_module(_LAZY[name]), name)
        globals()[name] = obj
        return obj
    raise AttributeError(f"module 'headlab.models' has no attribute {name!r}")
