"""What importance, ablation and pruning share: data in, batches, the per-example losses, progress.

Texts come as a list of strings (with a :class:`~headlab.models.loader.LoadedModel` that has a
tokenizer) or as token-id sequences (lists or 1-D tensors, for headlab's own models); a file
(:func:`read_texts`, through :mod:`headlab.reading`) as a TSV with a header (``sentence<TAB>label``,
SST-2's layout), a CoNLL-U file (its ``# text =`` lines) or plain text (one example per line).

Losses, per example (``loss=``):

=========  ======================================================================================
task       cross-entropy of a classifier's ``logits (B, C)`` against gold ``labels``
lm         next-token NLL of a decoder's ``logits (B, L, V)``, mean over the real tokens; of an
           encoder-decoder, the NLL of its decoder's own tokens: the examples' ``labels`` where they
           give them (the model's own loss, per example), else ``decoder_input_ids`` teacher-forced
kl         KL(p_0 || p) from the unpruned model's output distribution (a classifier's, or every
           next-token distribution of a decoder, averaged over real tokens; an encoder-decoder's over
           its decoder's tokens, a CTC head's over the real audio frames); no labels needed
cosine     1 - cos(e, e_0) of a sentence encoder's pooled embedding (mean of ``last_hidden_state``
           over real tokens, as sentence-transformers pools MiniLM; over the real frames of an audio
           encoder such as wav2vec2 or HuBERT); no labels needed
=========  ======================================================================================

``loss="auto"`` keeps what each model had: ``lm`` for a decoder with a language-model head, ``kl`` for
any other head (classifiers, encoder-decoders, CTC and token-tagging heads), ``cosine`` for a bare
encoder (audio encoders included).

Examples given as dicts of tensors (``{"input_features": ..., "decoder_input_ids": ...}``) are batched by
:func:`headlab.models.inputs.stack_examples`: token inputs of different lengths are padded with their
masks; audio or images of different shapes are refused, typed (pad them with the feature extractor's mask).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import torch
import torch.nn.functional as F

from headlab.errors import ConfigError, InputError, ShapeError
from headlab.models.base import ModelAdapter
from headlab.models.inputs import is_encoder_decoder, stack_examples

Loss = Literal["auto", "task", "lm", "kl", "cosine"]
LOSSES = ("task", "lm", "kl", "cosine")


def is_causal(adapter: ModelAdapter) -> bool:
    """Decoder (each token sees only the past) or encoder."""
    return adapter.causal


def _seq2seq(model) -> bool:
    return model is not None and is_encoder_decoder(model)


def _decoder_side(adapter) -> set[int]:
    """The layers whose queries are an encoder-decoder's decoder tokens (its decoder and cross-attention layers)."""
    stacks = getattr(adapter, "stacks", {}) or {}
    return {l for name in ("decoder", "cross") for l in stacks.get(name, ())} if "encoder" in stacks else set()


def same_tokens(adapter, a: int, b: int) -> bool:
    """Do layers ``a`` and ``b`` have the same query tokens (both on an encoder-decoder's decoder side, or not)?"""
    side = _decoder_side(adapter)
    return (a in side) == (b in side)


def read_texts(
    path: str | Path, *, limit: int | None = None, option: str = "--data"
) -> tuple[list[str], list[int] | None]:
    """``(texts, labels or None)`` of a file, read by :mod:`headlab.reading` as its suffix says: ``.tsv`` a
    dataset (a ``sentence`` or ``text`` column, an optional integer ``label``), ``.conllu`` the ``# text =``
    of each sentence, anything else one text per line; the first ``limit`` of them. ``option`` names the
    file in messages."""
    from headlab.reading import read_conllu, read_tsv
    from headlab.reading import read_texts as read_lines

    suffix = Path(path).suffix.lower()
    labels = None
    if suffix == ".tsv":
        rows = read_tsv(path, option)
        texts = [r.text for r in rows]
        labels = (
            None if rows[0].label is None else [cast(int, r.label) for r in rows]
        )  # a label column gives every row one
    elif suffix == ".conllu":
        texts = read_conllu(path, option).texts()
    else:
        texts = read_lines(path, option)
    if limit is not None:
        texts, labels = texts[:limit], (labels[:limit] if labels is not None else None)
    if not texts:
        raise InputError(f"{option} {str(path)!r} holds no examples (an empty dataset); give at least one text")
    return texts, labels


@dataclass
class Batch:
    inputs: dict  # input_ids (B, L), attention_mask (B, L)
    labels: torch.Tensor | None  # (B,) or None
    index: torch.Tensor  # (B,) positions of these examples in the dataset
    model: object = None  # the model (what maps an audio input's mask onto its frames)

    @property
    def size(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0])

    @property
    def device(self) -> torch.device:
        return next(iter(self.inputs.values())).device

    def output_mask(self, length: int) -> torch.Tensor:
        """``(B, length)`` real positions of the model's output: the decoder's in an encoder-decoder (its
        ``decoder_attention_mask``, else all), the input's otherwise."""
        if "decoder_input_ids" in self.inputs or "labels" in self.inputs and _seq2seq(self.model):
            m = self.inputs.get("decoder_attention_mask")
            if m is None and "decoder_input_ids" not in self.inputs:  # labels only: the model shifts them in
                m = self.inputs["labels"] != -100
            return torch.ones(self.size, length, dtype=torch.bool, device=self.device) if m is None else m.bool()
        return self.positions(length)

    def query_mask(self, adapter, layer: int, length: int) -> torch.Tensor:
        """``(B, length)`` real query rows of attention layer ``layer``: the decoder's tokens in an encoder-decoder's
        decoder and cross-attention layers, the input's (mapped onto audio frames) elsewhere."""
        if layer in _decoder_side(adapter):
            return self.output_mask(length)
        return self.positions(length)

    def key_mask(self, adapter, layer: int, length: int) -> torch.Tensor:
        """``(B, length)`` real keys of attention layer ``layer``: cross-attention reads the encoder's tokens."""
        if layer in adapter.stacks.get("cross", ()):
            return self.positions(length)
        return self.query_mask(adapter, layer, length)

    def positions(self, length: int) -> torch.Tensor:
        """``(B, length)`` real positions of an output of ``length`` positions along the input: the attention
        mask, mapped onto the frames where an audio front end subsamples the input (by the model's own rule:
        ``_get_feature_vector_attention_mask`` of wav2vec2-style models, ``_get_output_attention_mask`` of
        conformers such as Parakeet and LASR)."""
        m = self.mask
        if m is None or m.all():
            return torch.ones(self.size, length, dtype=torch.bool, device=self.device)
        if m.shape[1] == length:
            return m
        model = self.model
        if hasattr(model, "_get_feature_vector_attention_mask"):
            return model._get_feature_vector_attention_mask(length, m.long()).bool()  # type: ignore[operator]
        if hasattr(model, "_get_output_attention_mask"):
            return model._get_output_attention_mask(m.long(), target_length=length).bool()  # type: ignore[operator]
        raise ShapeError(
            f"the model's output has {length} positions but the attention_mask {m.shape[1]}, and "
            f"{type(model).__name__} says no rule between them; give unpadded examples (no attention_mask)"
        )

    @property
    def mask(self) -> torch.Tensor | None:
        """``(B, L)`` real tokens, or None for inputs without one (images: every position is real)."""
        m = self.inputs.get("attention_mask")
        return None if m is None else m.bool()


def check_data(texts, labels, loss: str) -> None:
    if texts is None or len(texts) == 0:
        raise InputError("no examples: pass at least one text (an empty dataset)")
    if loss == "task" and labels is None:
        raise InputError(
            "loss='task' needs gold labels (labels=..., or a 'label' column in the data file); "
            "without labels use loss='kl' (classifiers, decoders) or 'cosine' (sentence encoders)"
        )
    if labels is not None and len(labels) != len(texts):
        raise InputError(f"{len(texts)} texts but {len(labels)} labels")


def batches(
    loaded,
    adapter: ModelAdapter,
    texts,
    labels,
    batch_size: int,
    *,
    max_length: int | None = None,
    min_size: int = 1,
    by_length: bool = False,
) -> list[Batch]:
    """Consecutive batches (a tail smaller than ``min_size`` joins the batch before it); with
    ``by_length``, of examples sorted by token count, so a batch pads little (``Batch.index`` says
    where each example came from; only for studies whose result per example ignores its batch)."""
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    n = len(texts)
    order = list(range(n))
    if by_length and n > batch_size:
        order = sorted(order, key=_token_counts(loaded, texts).__getitem__)
        texts = [texts[i] for i in order]
        labels = None if labels is None else [labels[i] for i in order]
    bounds = list(range(0, n, batch_size))
    spans = [(s, min(s + batch_size, n)) for s in bounds]
    if len(spans) > 1 and spans[-1][1] - spans[-1][0] < min_size:
        spans[-2:] = [(spans[-2][0], spans[-1][1])]
    device = next(adapter.model.parameters()).device
    out = []
    for s, e in spans:
        chunk = texts[s:e]
        if all(isinstance(t, dict) for t in chunk):  # dicts of tensors (pixel_values, decoder ids ...), each a batch
            enc = {k: v.to(device) for k, v in stack_examples(adapter.model, chunk).items()}
        elif all(isinstance(t, str) for t in chunk):
            if loaded is None or loaded.tokenizer is None:
                raise InputError(
                    "text inputs need a LoadedModel with a tokenizer (headlab.load); "
                    "for headlab's own models pass token-id sequences"
                )
            enc = loaded.encode(list(chunk), max_length=max_length, truncate=max_length is not None)
        else:
            seqs = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for t in chunk]
            if any(len(q) == 0 for q in seqs):
                raise InputError("an empty token sequence; every example needs at least one token")
            L = max(len(q) for q in seqs)
            ids = torch.zeros(len(seqs), L, dtype=torch.long)
            att = torch.zeros(len(seqs), L, dtype=torch.long)
            for i, q in enumerate(seqs):
                ids[i, : len(q)], att[i, : len(q)] = q, 1
            enc = {"input_ids": ids.to(device), "attention_mask": att.to(device)}
        lab = None if labels is None else torch.as_tensor(list(labels[s:e]), dtype=torch.long, device=device)
        out.append(Batch(enc, lab, torch.as_tensor(order[s:e], dtype=torch.long), adapter.model))
    return out


def _token_counts(loaded, texts) -> list[int]:
    """Tokens of each example (strings through the model's tokenizer, special tokens included)."""
    if all(isinstance(t, str) for t in texts) and loaded is not None and loaded.tokenizer is not None:
        return [len(ids) for ids in loaded.tokenizer(list(texts))["input_ids"]]
    return [len(t) for t in texts]  # token-id sequences (text without a tokenizer is refused by batches)


def choose_loss(adapter: ModelAdapter, loss: str, labels) -> Loss:
    if loss == "auto":
        if labels is not None and _is_classifier(adapter):  # labels in a file meant for another model: not a task
            return "task"
        if is_causal(adapter) and _has_task_head(adapter):
            return "lm"
        return "kl" if _has_task_head(adapter) else "cosine"  # a bare encoder or decoder: the cosine surrogate
    if loss not in LOSSES:
        raise ConfigError(f"unknown loss {loss!r}; use one of {', '.join(LOSSES)} (or 'auto')")
    if loss == "lm" and not is_causal(adapter) and not _seq2seq(adapter.model):
        raise ConfigError(
            "loss='lm' (next-token NLL) needs a decoder; this model is an encoder: use 'task', 'kl' or 'cosine'"
        )
    return cast(Loss, loss)  # checked in LOSSES above


def _is_classifier(adapter: ModelAdapter) -> bool:
    return type(adapter.model).__name__.endswith("ForSequenceClassification")


# heads whose logits give a distribution per position (a CTC head over audio frames, a token tagger): loss='kl'
_PER_POSITION_HEADS = ("ForCTC", "ForTokenClassification", "ForAudioFrameClassification")


def _has_task_head(adapter: ModelAdapter) -> bool:
    return adapter.has_task_head or type(adapter.model).__name__.endswith(_PER_POSITION_HEADS)


def logits_of(out) -> torch.Tensor:
    lg = getattr(out, "logits", None)
    if lg is None:
        raise ConfigError(
            f"the model returns no logits ({type(out).__name__}); for a sentence encoder use loss='cosine'"
        )
    return lg


def pooled(out, mask: torch.Tensor | None, batch: Batch | None = None) -> torch.Tensor:
    """Mean of ``last_hidden_state (B, L, E)`` over real tokens: ``(B, E)``."""
    h = getattr(out, "last_hidden_state", None)
    if h is None:
        raise ConfigError(
            f"loss='cosine' needs a sentence encoder's last_hidden_state; {type(out).__name__} has none "
            "(use loss='kl' for a classifier or decoder)"
        )
    if mask is None:
        return h.mean(1)
    if mask.shape[1] != h.shape[1] and batch is not None:  # audio: the mask runs over samples, h over frames
        mask = batch.positions(h.shape[1])
    m = mask.to(h.dtype).unsqueeze(-1)  # (B, L, 1)
    return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


def reference(loss: str, out, batch: Batch, *, generator: torch.Generator | None = None) -> dict:
    """What a label-free loss compares with, from the unpruned model's output on ``batch``."""
    if loss == "kl":
        lp = F.log_softmax(up(logits_of(out)), -1).detach()
        ref = {"logp": lp}
        if generator is not None:  # own-sample labels for the importance surrogate
            flat = lp.exp().reshape(-1, lp.shape[-1])
            ref["sample"] = torch.multinomial(flat.cpu(), 1, generator=generator).view(lp.shape[:-1]).to(lp.device)
        return ref
    if loss == "cosine":
        e = up(pooled(out, batch.mask, batch)).detach()
        ref = {"emb": e}
        if generator is not None:  # a random unit direction orthogonal to e_0, per example
            u = torch.randn(e.shape, generator=generator).to(e)
            en = e / e.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            u = u - (u * en).sum(-1, keepdim=True) * en
            ref["dir"] = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return ref
    return {}


def up(x: torch.Tensor) -> torch.Tensor:
    """float16/bfloat16 -> float32; float32 and float64 stay."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum(-1) / m.sum(-1).clamp_min(1.0)


def _decoder_nll(lg: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``(B,)`` an encoder-decoder's NLL of its decoder's own tokens, mean over the real ones: of ``labels`` where
    the examples give them (the model's own loss, example by example), else of ``decoder_input_ids`` teacher-forced
    (position t predicts token t + 1)."""
    if "labels" in batch.inputs:
        target = batch.inputs["labels"]
        nll = F.cross_entropy(lg.transpose(1, 2), target.clamp_min(0), reduction="none")  # (B, T)
        return _token_mean(nll, target != -100)
    ids = batch.inputs["decoder_input_ids"]
    real = batch.output_mask(ids.shape[1])
    nll = F.cross_entropy(lg[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
    return _token_mean(nll, real[:, 1:] & real[:, :-1])


def per_example(loss: str, out, batch: Batch, ref: dict, *, surrogate: bool = False) -> torch.Tensor:
    """``(B,)`` loss of every example. ``surrogate=True``: the first-order forms head_importance
    differentiates for the label-free losses (see :func:`headlab.head_importance`)."""
    if loss == "task":
        lg = logits_of(out)
        if lg.dim() != 2:
            raise ConfigError(f"loss='task' needs a classifier's logits (B, classes); got shape {tuple(lg.shape)}")
        if batch.labels is None:
            raise InputError("loss='task' needs gold labels")
        if int(batch.labels.max()) >= lg.shape[-1] or int(batch.labels.min()) < 0:
            raise InputError(f"labels must lie in 0..{lg.shape[-1] - 1} (the classifier's classes)")
        return F.cross_entropy(up(lg), batch.labels, reduction="none")
    if loss == "lm" and _seq2seq(batch.model):  # an encoder-decoder: the decoder's own tokens
        return _decoder_nll(up(logits_of(out)), batch)
    if loss == "lm":
        lg = up(logits_of(out))
        ids, mask = batch.inputs["input_ids"], batch.mask
        assert mask is not None  # text: the tokenizer gave an attention mask
        nll = F.cross_entropy(lg[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # (B, L-1)
        return _token_mean(nll, mask[:, 1:] & mask[:, :-1])
    if loss == "kl":
        lp = F.log_softmax(up(logits_of(out)), -1)
        if surrogate:  # -log p(y*) with y* drawn from the unpruned distribution
            val = -lp.gather(-1, ref["sample"].unsqueeze(-1)).squeeze(-1)
        else:
            p0 = ref["logp"].exp()
            val = (p0 * (ref["logp"] - lp)).sum(-1)
        if val.dim() == 2:  # per token (decoders): mean over real tokens
            return _token_mean(val, batch.output_mask(val.shape[1]))
        return val
    if loss == "cosine":
        e = up(pooled(out, batch.mask, batch))
        e0 = ref["emb"]
        if surrogate:  # u . e / |e_0| with u a unit direction orthogonal to e_0
            return (ref["dir"] * e).sum(-1) / e0.norm(dim=-1).clamp_min(1e-12)
        return 1.0 - F.cosine_similarity(e, e0, dim=-1)
    raise ConfigError(f"unknown loss {loss!r}")


def accuracy(out, batch: Batch) -> torch.Tensor | None:
    """``(B,)`` 1.0 where a classifier's argmax equals the gold label (None without labels/classifier)."""
    lg = getattr(out, "logits", None)
    if batch.labels is None or lg is None or lg.dim() != 2:
        return None
    return (lg.argmax(-1) == batch.labels).float()


@contextmanager
def pre_hooks(adapter: ModelAdapter, fn) -> Iterator[None]:
    """``fn(layer, z (B, H_l, L, d)) -> z or None`` edits every layer's per-head outputs z.

    Through the adapter's hook sites (``adapter.hooks({"blocks.L.attn.z": ...})``: before the gates,
    on every backend); adapters without them get a pre-hook on W^O's input (after the gates)."""
    if hasattr(adapter, "hooks"):

        def site_fn(layer):
            def edit(z, site):
                new = fn(layer, z)
                return z if new is None else new

            return edit

        with adapter.hooks({adapter.site_name(layer, "z"): site_fn(layer) for layer in range(adapter.n_layers)}):
            yield
        return
    d = adapter.head_dim
    handles = []

    def make(layer):
        def hook(module, args):
            x = args[0]
            lead = x.shape[:-1]
            H = x.shape[-1] // d
            z = x.reshape(*lead, H, d).movedim(-2, -3)  # (B, L, H*d) -> (B, H, L, d)
            z2 = fn(layer, z)
            if z2 is None or z2 is z:
                return None
            return (z2.movedim(-3, -2).reshape(*lead, H * d), *args[1:])

        return hook

    try:
        for layer, op in enumerate(adapter.out_projs):
            handles.append(op.register_forward_pre_hook(make(layer)))
        yield
    finally:
        for h in handles:
            h.remove()


def safe_float(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (ties get their average rank), or None when either side is constant."""
    import numpy as np
    from scipy.stats import rankdata

    ra, rb = rankdata(np.asarray(a, dtype=float)), rankdata(np.asarray(b, dtype=float))
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def token_ids_if_needed(loaded, texts: list[str]) -> list:
    """For a model without a tokenizer, lines of space-separated integers become token-id lists."""
    if loaded is not None and getattr(loaded, "tokenizer", None) is not None:
        return texts
    out = []
    for i, t in enumerate(texts):
        try:
            out.append([int(x) for x in t.split()])
        except ValueError:
            raise InputError(
                f"this model has no tokenizer, so each example must be space-separated token ids; "
                f"example {i + 1} is {t[:40]!r}"
            ) from None
    return out
