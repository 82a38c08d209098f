"""``headlab.explain``: nine explanations of one prediction, side by side, and how much they agree.

    >>> import headlab                                                    # doctest: +SKIP
    >>> ex = headlab.explain("~/.cache/headlab/minilm-sst2", "a gripping , funny film")  # doctest: +SKIP
    >>> ex.tokens, ex.target, ex.probs                                    # doctest: +SKIP
    >>> ex.scores["integrated_gradients"]; ex.agreement()                 # doctest: +SKIP

Definitions (one input; ``e_t`` the word embedding of token t, the output of the embedding lookup
before position embeddings and normalisation; ``y`` the target class's logit, or for a decoder the
logit of the target next token at the last position, the target being the predicted one unless given):

- ``attention``: the last layer's attention from the classification position ([CLS], or the last
  token for a decoder), mean over heads (every layer and head: :meth:`Explanation.attention_head`);
- ``gradient``: ``||dy/de_t||_2``;
- ``grad_x_input``: ``sum_d (dy/de_t)_d e_t,d`` (signed);
- ``integrated_gradients``: straight-line IG at the word-embedding layer from the default baseline
  (special tokens kept, the others replaced by the pad, else unk, embedding), ``ig_steps``
  Gauss-Legendre points; :attr:`Explanation.completeness_gap` is ``|sum_t IG_t - (y(x) - y(b))| /
  |y(x) - y(b)|`` and a :class:`CompletenessWarning` is raised above 1%;
- ``leave_one_out``: ``TVD(p(x), p(x without t))`` with t deleted (``loo="delete"``) or replaced by
  the mask (``"mask"``) or unk (``"unk"``) token;
- ``rollout``, ``norm_rollout``, ``attention_flow``, ``attention_norm``: the classification
  position's row of the attention rollout, of the norm-based rollout, the attention flow from it at
  the last layer, and its row of the last layer's norm map (:mod:`.propagation`).

:data:`DEFAULT_METHODS` is every method but ``attention_flow``, which solves one max-flow per token
(about 12 s of CPU at 256 tokens on MiniLM): ask for it by name.

Special tokens are reported (their scores are in the lists) but left out of rankings and
agreement unless ``include_special=True``. Everything runs on ``backend`` (``"sdpa"``, ``"tiled"``
with its own backward, ...); only the attention method, which needs the map, runs its captured
layers on the reference path, and the flow methods run on the exact model when ``backend`` is
approximate (the notes say so). A model with no head explains the cosine similarity of its
mean-pooled embedding to ``compare_to``.
"""

from __future__ import annotations

import difflib
import math
import os
import warnings
from dataclasses import dataclass, field

import torch

from headlab.attention import backends as _backends
from headlab.errors import ConfigError, InputError
from headlab.interpret.saliency.agreement import Agreement, agreement
from headlab.interpret.saliency.attention import attention_rows
from headlab.interpret.saliency.gradients import gradient_scores
from headlab.interpret.saliency.integrated import default_baseline, integrated_gradients, quadrature
from headlab.interpret.saliency.objective import Objective, baseline_id, make_objective, special_mask
from headlab.interpret.saliency.occlusion import leave_one_out, replacement_id
from headlab.interpret.saliency.propagation import FLOW_METHODS, exact_backend, flow_score
from headlab.models.loader import LoadedModel
from headlab.results import envelope

# every known method, in the order tables list them
METHODS = ("attention", "gradient", "grad_x_input", "integrated_gradients", "leave_one_out", *FLOW_METHODS)
# what runs unless methods= says otherwise: all but attention flow (one max-flow per token: slow on long inputs)
DEFAULT_METHODS = tuple(m for m in METHODS if m != "attention_flow")
COMPLETENESS_TOLERANCE = 0.01


class CompletenessWarning(UserWarning):
    """Integrated gradients missed completeness by more than 1%: use more steps."""


@dataclass
class Explanation:
    """Every method's per-token scores for one input, and what was explained.

    Attributes:
        text: the input; tokens: its tokens (special ones included); special: which are special.
        kind: ``"classifier"``, ``"next_token"`` or ``"similarity"``.
        target: the class (or token id) whose logit y is; target_label: its name, if known.
        probs: the output distribution (classes; for next_token the top of it is not kept) or None.
        y: the explained scalar at the input.
        scores: ``{method: [score per token]}``.
        completeness_gap: IG's relative completeness gap (None without IG).
        y_baseline: y at the IG baseline (None without IG).
        attention_layers: ``(n_layers, H, L)`` attention rows from the classification position (or None).
        backend, ig_steps, loo: how it was computed. notes: what was skipped or warned, and why.
    """

    text: str
    tokens: list[str]
    special: list[bool]
    kind: str
    target: int | None
    target_label: str | None
    probs: list[float] | None
    y: float
    scores: dict[str, list[float]]
    completeness_gap: float | None = None
    y_baseline: float | None = None
    # (layers, H, L): attention from the classification position; a list of (H_l, L) for a pruned
    # model whose layers keep different numbers of heads
    attention_layers: torch.Tensor | list[torch.Tensor] | None = None
    backend: str = "auto"
    ig_steps: int = 50
    loo: str = "delete"
    position: int = 0
    notes: list[str] = field(default_factory=list)

    def _repr_html_(self) -> str:
        """This result's page inline in a notebook (headlab's shell in a sandboxed frame; no network)."""
        from headlab.interpret import shell
        from headlab.interpret.saliency.html import render_explanation_html

        return shell.inline(render_explanation_html(self), height=520)

    @property
    def methods(self) -> list[str]:
        return list(self.scores)

    def keep(self, include_special: bool = False) -> list[bool]:
        return [True] * len(self.tokens) if include_special else [not s for s in self.special]

    def ranking(self, method: str, *, include_special: bool = False, magnitude: bool = False) -> list[int]:
        """Token positions from most to least important by ``method`` (signed scores unless ``magnitude``)."""
        s = self.scores[method]
        idx = [i for i, k in enumerate(self.keep(include_special)) if k]
        return sorted(idx, key=lambda i: -(abs(s[i]) if magnitude else s[i]))

    def agreement(self, methods=None, *, magnitude: bool = True, include_special: bool = False) -> Agreement:
        """Kendall tau (+ p) and Spearman between every pair of methods (see :mod:`.agreement`)."""
        chosen = {m: self.scores[m] for m in (methods or self.methods)}
        return agreement(chosen, self.keep(include_special), magnitude=magnitude, include_special=include_special)

    def attention_head(self, layer: int, head: int | None = None) -> list[float]:
        """Attention from the classification position in ``layer`` (negative counts from the end), one head or the mean."""
        if self.attention_layers is None:
            raise ConfigError("no attention was computed: include 'attention' in methods")
        rows = self.attention_layers[layer]  # (H, L)
        return (rows.mean(0) if head is None else rows[head]).tolist()

    def to_json(self, *, heads: bool = False) -> dict:
        clean = lambda v: None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v
        out = {
            "text": self.text,
            "tokens": self.tokens,
            "special": self.special,
            "kind": self.kind,
            "target": self.target,
            "target_label": self.target_label,
            "probs": self.probs,
            "y": self.y,
            "scores": self.scores,
            "agreement": self.agreement().to_json() if len(self.scores) > 1 else None,
            "completeness_gap": clean(self.completeness_gap),
            "y_baseline": self.y_baseline,
            "backend": self.backend,
            "ig_steps": self.ig_steps,
            "loo": self.loo,
            "position": self.position,
            "notes": self.notes,
        }
        if heads and self.attention_layers is not None:
            out["attention_layers"] = [rows.tolist() for rows in self.attention_layers]
        settings = {
            "methods": list(self.scores),
            "target": self.target,
            "backend": self.backend,
            "ig_steps": self.ig_steps,
            "loo": self.loo,
            "position": self.position,
        }
        return envelope("explanation", out, settings=settings)


def check_methods(methods) -> list[str]:
    """The methods as a list, or :class:`~headlab.errors.ConfigError` naming the known ones."""
    if isinstance(methods, str):
        methods = [m for m in methods.replace(",", " ").split() if m]
    methods = list(methods)
    if not methods:
        raise ConfigError(f"no methods given; known: {', '.join(METHODS)}")
    for m in methods:
        if m not in METHODS:
            close = difflib.get_close_matches(str(m), METHODS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown method {m!r}{hint}; known methods: {', '.join(METHODS)}")
    return list(dict.fromkeys(methods))


def resolve_model(loaded_or_path) -> LoadedModel:
    from headlab.models.loader import load

    if isinstance(loaded_or_path, LoadedModel):
        return loaded_or_path
    if isinstance(loaded_or_path, (str, os.PathLike)):
        return load(loaded_or_path)
    raise ConfigError(
        f"explain needs a LoadedModel (headlab.load) or a model name/path, got {type(loaded_or_path).__name__}"
    )


def check_options(methods, ig_steps: int, backend, loo: str) -> list[str]:
    """Validate everything that needs no model (raise before any long work)."""
    methods = check_methods(methods)
    quadrature(ig_steps)  # ConfigError for ig_steps < 1
    if not (isinstance(backend, str) and backend == "auto"):
        _backends.get(backend)  # UnknownBackendError naming the known ones
    from headlab.interpret.saliency.occlusion import LOO_MODES

    if loo not in LOO_MODES:
        raise ConfigError(f"unknown loo mode {loo!r}; known: {', '.join(LOO_MODES)}")
    return methods


def explain(
    loaded_or_path,
    text: str,
    target: int | None = None,
    methods=DEFAULT_METHODS,
    ig_steps: int = 50,
    backend: str = "auto",
    *,
    loo: str = "delete",
    compare_to: str | None = None,
    truncate: bool = False,
    ig_method: str = "gausslegendre",
    ig_batch_size: int | None = None,
    attention_layers: str = "auto",
    warn: bool = True,
) -> Explanation:
    """Explain one prediction with each of ``methods``; see the module docstring for the definitions.

    It runs the ``explain`` instrument (``headlab explain TEXT``) through the study runner
    (:func:`headlab.interpret.study.runner.call`): the same checks, load and unit (:func:`explanation`, the one
    text) as the command; under torchrun every rank returns the explanation.

    Args:
        loaded_or_path: a :class:`~headlab.models.loader.LoadedModel` or a name/folder for :func:`headlab.load`.
        text: the input (one text).
        target: the class (or next-token id) to explain; default the predicted one.
        methods: any of :data:`METHODS` (``attention, gradient, grad_x_input, integrated_gradients,
            leave_one_out, rollout, norm_rollout, attention_flow, attention_norm``); default
            :data:`DEFAULT_METHODS` (all but ``attention_flow``).
        ig_steps: quadrature points for IG (>= 1). backend: the attention backend for every pass.
        loo: ``"delete"`` (Jain and Wallace), ``"mask"`` or ``"unk"``.
        compare_to: for a model with no head, explain ``cos(pool(text), pool(compare_to))``.
        truncate: keep the first positions of a too-long text instead of raising InputError.
        attention_layers: ``"all"`` (every layer's rows), ``"last"``, or ``"auto"`` (all up to 512 tokens).
        warn: raise :class:`CompletenessWarning` when IG's gap exceeds 1%.
    """
    from headlab.interpret.study import runner

    options = {
        "model": loaded_or_path,
        "text": text,
        "target": target,
        "methods": methods,
        "ig_steps": ig_steps,
        "backend": backend,
        "loo": loo,
        "compare_to": compare_to,
        "truncate": truncate,
        "ig_method": ig_method,
        "ig_batch_size": ig_batch_size,
        "attention_layers": attention_layers,
        "warn": warn,
    }
    return runner.call("explain", options)


def explanation(
    loaded_or_path,
    text: str,
    target: int | None = None,
    methods=DEFAULT_METHODS,
    ig_steps: int = 50,
    backend: str = "auto",
    *,
    loo: str = "delete",
    compare_to: str | None = None,
    truncate: bool = False,
    ig_method: str = "gausslegendre",
    ig_batch_size: int | None = None,
    attention_layers: str = "auto",
    warn: bool = True,
) -> Explanation:
    """The explanation of one text, computed here (the ``explain`` instrument's unit, what :func:`explain` runs;
    the corpus study's rows and the report's saliency strip call it inside their own units). Arguments as
    :func:`explain`'s.
    """
    methods = check_options(methods, ig_steps, backend, loo)
    if not isinstance(text, str):
        raise InputError(f"text must be a string, got {type(text).__name__}")
    loaded = resolve_model(loaded_or_path)
    enc = loaded.encode(text, truncate=truncate)
    if "leave_one_out" in methods:
        replacement_id(Objective(loaded, "classifier", 0, False), loo)  # a missing mask/unk token, early
    ids, mask = enc["input_ids"], enc["attention_mask"]
    tokens = loaded.tokenizer.convert_ids_to_tokens(ids[0].tolist())
    special = special_mask(loaded, ids)
    adapter = loaded.adapter
    with adapter.use_backend(backend):
        objective, info = make_objective(loaded, enc, target, compare_to)
        with torch.no_grad():
            y, p = objective.y_and_probs(ids, mask)
        probs = None
        if p is not None and objective.kind == "classifier":
            probs = p[0].tolist()
        labels = info.get("labels")
        ex = Explanation(
            text=text,
            tokens=tokens,
            special=special,
            kind=objective.kind,
            target=objective.target,
            target_label=labels[objective.target] if labels and objective.target is not None else None,
            probs=probs,
            y=float(y[0]),
            scores={},
            backend=str(backend),
            ig_steps=ig_steps,
            loo=loo,
            position=objective.position(mask),
        )
        grads = None
        for m in methods:
            if m == "attention":
                layers = attention_layers if attention_layers != "auto" else ("all" if ids.shape[1] <= 512 else "last")
                rows = attention_rows(objective, ids, mask, layers)  # (layers, H, L)
                ex.attention_layers = rows
                ex.scores[m] = rows[-1].mean(0).tolist()
            elif m in ("gradient", "grad_x_input"):
                grads = grads or gradient_scores(objective, ids, mask)
                ex.scores[m] = grads[m].tolist()
            elif m == "integrated_gradients":
                base = default_baseline(objective, ids, special, baseline_id(loaded))
                ig = integrated_gradients(
                    objective, ids, mask, base, steps=ig_steps, method=ig_method, batch_size=ig_batch_size
                )
                ex.scores[m] = ig.scores.tolist()
                ex.completeness_gap, ex.y_baseline = ig.completeness_gap, ig.y_baseline
                if ig.completeness_gap > COMPLETENESS_TOLERANCE:
                    note = (
                        f"integrated gradients: completeness gap {100 * ig.completeness_gap:.2f}% > 1% at "
                        f"{ig_steps} steps (y - y_baseline = {ig.y - ig.y_baseline:.4g}); use more ig_steps"
                    )
                    ex.notes.append(note)
                    if warn:
                        warnings.warn(note, CompletenessWarning, stacklevel=2)
            elif m == "leave_one_out":
                ex.scores[m] = leave_one_out(objective, ids, mask, special, loo).tolist()
            elif m in FLOW_METHODS:
                exact, flow_note = exact_backend(backend)
                if flow_note and flow_note not in ex.notes:
                    ex.notes.append(flow_note)
                ex.scores[m], more = flow_score(loaded, enc, ex.position, m, exact)
                if more:
                    ex.notes.append(more)
    return ex
