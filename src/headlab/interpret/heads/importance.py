"""Head importance (Michel et al. 2019) and confidence (Voita et al. 2019), with their rank agreement.

Michel et al. gate each head's output with ``xi_h`` (here the per-head output z_h before W^O, which
is what :attr:`ModelAdapter.gates` multiplies) and score a head by the expected absolute derivative
of the loss, per example::

    I_h = E_x | dL(x) / d xi_h |          evaluated at xi = 1

(the absolute value of each example's derivative, not of the mean derivative). With
``normalize=True`` each layer is divided by its L2 norm, as in the paper.

One forward and one backward per batch give every head of every layer for every example: each
example gets its own copy of the gates, ``xi (B, n_layers, H)`` applied by a hook on the input of
every W^O, so that ``d sum_b L(x_b) / d xi[b]`` is example b's own derivative.

Label-free losses. KL(p_0 || p) and the cosine distance to the unpruned embedding are both at their
minimum at xi = 1: their derivative there is exactly zero. ``head_importance`` therefore
differentiates first-order forms whose *squared* derivative, in expectation, is the second
derivative (the curvature) of the label-free loss:

- ``kl``: ``-log p(y* | x)`` with ``y*`` drawn from the unpruned distribution (per token for a
  decoder); ``E_y* (d log p(y*) / d xi)^2`` is the Fisher information, ``d^2 KL / d xi^2`` at xi = 1;
- ``cosine``: ``u . e(x) / |e_0(x)|`` with ``u`` a random unit vector orthogonal to ``e_0``;
  ``E_u (u . de/dxi)^2 / |e_0|^2 = |P_perp de/dxi|^2 / (|e_0|^2 (D - 1))``, proportional to
  ``d^2 (1 - cos) / d xi^2``.

Draws come from ``seed``; the measured effect of removing a head (:func:`headlab.ablate`) is the
check that the ranking means something, and :func:`importance_study` reports the rank correlation.

Confidence (Voita et al.): the mean over real tokens of each query row's largest attention weight,
from the streaming statistics (:func:`headlab.attention_stats`, capture site ``stats``): no map held.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from headlab.distributed.data import is_main
from headlab.errors import InputError
from headlab.interpret.heads import examples as C
from headlab.interpret.heads.edits import head_hooks
from headlab.models.loader import resolve
from headlab.progress import Progress, reporter
from headlab.results import envelope, read_json, write_json


def _gates_hook(adapter, holder: dict):
    """Per-example gates: z_h of example b is multiplied by ``holder['xi'][b, layer, h]`` (on a sharded model, each
    rank gates the heads it holds, so ``d loss / d xi`` of a head is found on its owner)."""

    def fn(layer, z, heads):  # z (B, H_l, L, d): the heads `heads` (global indices)
        xi = holder.get("xi")
        if xi is None:
            return None
        g = xi[:, layer, heads.start : heads.stop].to(z.dtype)  # (B, H_l)
        return z * g[:, :, None, None]

    return head_hooks(adapter, fn)


def head_importance(
    loaded,
    texts,
    labels=None,
    *,
    loss: C.Loss = "auto",
    batch_size: int = 16,
    normalize: bool = False,
    backend: str = "auto",
    seed: int = 0,
    max_length: int | None = None,
    progress: bool | Progress = False,
) -> torch.Tensor:
    """Michel et al.'s ``I_h = E_x |dL(x)/d xi_h|`` for every head: ``(n_layers, H)``.

    Args:
        loaded: a :class:`~headlab.models.loader.LoadedModel`, a model or an adapter.
        texts: strings (needs a tokenizer) or token-id sequences.
        labels: gold class ids for ``loss="task"``.
        loss: ``"task"``, ``"lm"``, ``"kl"``, ``"cosine"`` or ``"auto"`` (task for a classifier given
            labels, lm for decoders, kl for classifiers, cosine for sentence encoders). See the module
            docstring.
        batch_size: examples per forward + backward.
        normalize: divide each layer by its L2 norm (Michel et al.).
        backend: the attention backend (one with a backward: ``sdpa``, ``tiled``, ``reference``).
        seed: draws of the label-free surrogates.

    It runs as ``headlab heads importance`` does (:func:`headlab.interpret.study.runner.call`, the instrument
    ``heads-importance``: one unit per batch, progress ``("batches", done, total)``), without the confidence; the
    grid is the result's ``normalized`` with ``normalize``, else its ``importance``. The adapter's own gates stay
    as they are (a head gated to 0 scores 0). Under ``torchrun`` (a process group from
    :func:`headlab.distributed.data.init_from_env`) the runner gives each rank every W-th batch and every rank
    gets every batch's sums: the result equals one process's (exactly for the ``task`` and ``lm`` losses; the
    ``kl``/``cosine`` surrogates draw per rank, so equal in expectation). On a model sharded by tensor parallelism
    a group runs its batches together, each head's derivative is taken on the rank that holds it, and the grid is
    added over the group: one process's result, every loss included.

        >>> import torch
        >>> from headlab.models.transformer import Transformer, TransformerConfig
        >>> m = Transformer(TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, causal=True)).eval()
        >>> texts = [torch.randint(0, 40, (9,)) for _ in range(6)]
        >>> head_importance(m, texts, loss="lm", batch_size=3).shape
        torch.Size([2, 4])
    """
    r = _study(
        loaded,
        texts,
        labels,
        loss=loss,
        batch_size=batch_size,
        backend=backend,
        seed=seed,
        confidence=False,
        max_length=max_length,
        progress=progress,
    )
    return r.normalized if normalize else r.importance


def _study(loaded, texts, labels, *, progress, **settings) -> ImportanceResult:
    """The instrument ``heads-importance`` run for a library function (its Python-only options: the texts and
    labels in memory, the library's settings)."""
    from headlab.interpret.study import runner

    return runner.call(
        "heads-importance", {"model": loaded, "texts": texts, "labels": labels, **settings}, progress=progress
    )


def importance_scores(
    loaded, texts, labels, *, loss, batch_size, normalize, backend, seed, max_length, progress, local: bool = False
):
    """``(grid, loss used, seconds)`` of :func:`head_importance`. ``local``: every example on this process, no sum
    over the data ranks (a caller running on one rank of several, as a unit of the study runner does); a model
    sharded by heads still adds each head's sum over its group."""
    adapter, ld = resolve(loaded)
    loss = C.choose_loss(adapter, loss, labels)
    C.check_data(texts, labels, loss)
    # under torchrun each rank takes every W-th example and the sums are added (identity on one process); a
    # sharded model runs every example on every rank, and each head's sum is made on its owner
    place = adapter.placement
    mine = list(range(len(texts))) if local else place.examples(len(texts))
    data = (
        C.batches(
            ld,
            adapter,
            [texts[i] for i in mine],
            None if labels is None else [labels[i] for i in mine],
            batch_size,
            max_length=max_length,
        )
        if mine
        else []
    )
    progress = progress if is_main() else False  # rank 0 reports
    gen = torch.Generator().manual_seed(seed + (0 if local else place.data_rank))
    total = torch.zeros(adapter.n_layers, adapter.n_heads, dtype=torch.float64)
    t0 = time.perf_counter()
    with gated(adapter, backend) as holder, reporter(progress) as say:
        stage = f"importance ({loss})"
        say(stage, 0, len(data))
        for n, b in enumerate(data, 1):
            total += importance_sums(adapter, b, holder, loss, gen)
            say(stage, n, len(data))
    total = place.sum_group(total) if local else place.sum_heads(total)
    return importance_grid(adapter, total, len(texts), normalize), loss, time.perf_counter() - t0


@contextlib.contextmanager
def gated(adapter, backend: str):
    """The model in eval mode with per-example gates on every head (``holder['xi']``, set per batch by
    :func:`importance_sums`), on ``backend``; the training mode is restored after."""
    holder: dict = {}
    was_training = adapter.model.training
    adapter.model.eval()
    try:
        with adapter.use_backend(backend), _gates_hook(adapter, holder):
            yield holder
    finally:
        holder.clear()
        adapter.model.train(was_training)


def importance_sums(adapter, b: C.Batch, holder: dict, loss: str, gen: torch.Generator) -> torch.Tensor:
    """``sum_x |dL(x)/d xi_h|`` over the examples of batch ``b``, ``(n_layers, H)`` float64 (inside :func:`gated`;
    on a sharded model, the heads this rank holds, zero elsewhere). ``gen``: the label-free surrogates' draws."""
    ref = {}
    if loss in ("kl", "cosine"):
        holder["xi"] = None
        with torch.no_grad():
            ref = C.reference(loss, adapter.forward(b.inputs), b, generator=gen)
    xi = torch.ones(b.size, adapter.n_layers, adapter.n_heads, dtype=torch.float32, device=b.device, requires_grad=True)
    holder["xi"] = xi
    with torch.enable_grad():
        per = C.per_example(loss, adapter.forward(b.inputs), b, ref, surrogate=True)  # (B,)
        (grad,) = torch.autograd.grad(per.sum(), xi, allow_unused=True)
    if grad is None:
        return torch.zeros(adapter.n_layers, adapter.n_heads, dtype=torch.float64)
    return grad.detach().abs().sum(0).double().cpu()


def importance_grid(adapter, total: torch.Tensor, n: int, normalize: bool) -> torch.Tensor:
    """The importance ``(n_layers, H)`` from the sums over ``n`` examples: NaN for a pruned model's missing heads,
    each layer divided by its L2 norm with ``normalize``."""
    imp = (total / n).float()
    for layer, count in enumerate(adapter.layer_heads):
        imp[layer, count:] = float("nan")  # a pruned model's missing heads
    if normalize:
        norms = torch.nan_to_num(imp).norm(dim=-1, keepdim=True)
        imp = imp / norms.clamp_min(1e-20)
    return imp


def confidence_sums(adapter, b: C.Batch) -> tuple[torch.Tensor, float]:
    """``(sum of max_j P_ij over the real query rows (n_layers, H) float64, the rows counted)`` for batch ``b``
    (on a sharded model, the heads this rank holds, zero elsewhere; the count alike on every rank)."""
    from headlab.interpret.capture import capture

    total = torch.zeros(adapter.n_layers, adapter.n_heads, dtype=torch.float64)
    # statistics made where the heads live; a sharded model keeps them there (gather="none")
    cache = capture(
        adapter,
        b.inputs,
        adapter.sites("stats"),
        gather="none",
        stats_kwargs={"stats": ["max_weight"], "method": "tiled"},
    )
    assert b.mask is not None  # text: the tokenizer gave an attention mask
    m = b.mask.to(torch.float64)  # (B, L) real query rows
    for layer in range(adapter.n_layers):
        site = adapter.site_name(layer, "stats")
        mw, heads = cache[site].max_weight.double(), cache.heads(site)  # (B, H_l, L), their global indices
        total[layer, heads.start : heads.stop] += (mw * m[:, None, :]).sum((0, 2)).cpu()
    return total, float(m.sum())


def confidence_grid(adapter, total: torch.Tensor, count: float) -> torch.Tensor:
    """Voita's confidence ``(n_layers, H)`` from the sums and the rows counted (NaN for missing heads)."""
    conf = (total / max(count, 1.0)).float()
    for layer, n in enumerate(adapter.layer_heads):
        conf[layer, n:] = float("nan")
    return conf


def head_confidence(
    loaded, texts, *, batch_size: int = 16, max_length: int | None = None, progress: bool | Progress = False
) -> torch.Tensor:
    """Voita et al.'s confidence: mean over real query tokens of ``max_j P_ij``, ``(n_layers, H)``.

    Computed from streaming statistics (``stats`` site, ``max_weight``, tiled method): no
    ``n x n`` map is ever held."""
    adapter, ld = resolve(loaded)
    C.check_data(texts, None, "cosine")
    place = adapter.placement
    mine = place.examples(len(texts))  # data-parallel under torchrun, as in head_importance
    data = C.batches(ld, adapter, [texts[i] for i in mine], None, batch_size, max_length=max_length) if mine else []
    progress = progress if is_main() else False  # rank 0 reports
    L, H = adapter.n_layers, adapter.n_heads
    total = torch.zeros(L, H, dtype=torch.float64)
    count = 0.0
    with reporter(progress) as say:
        say("confidence", 0, len(data))
        for n, b in enumerate(data, 1):
            sums, rows = confidence_sums(adapter, b)
            total += sums
            count += rows
            say("confidence", n, len(data))
    if not place.sharded:  # the examples were split over the ranks: add their sums and token counts
        summed = place.sum_over_data(torch.cat([total.flatten(), torch.tensor([count], dtype=torch.float64)]))
        total, count = summed[:-1].view(L, H), float(summed[-1])
    else:  # a tensor-parallel group ran its examples; each head's sum was made on the rank holding it
        total = place.sum_heads(total)
        # the token count is the same on every rank of a group: add it over the groups of a 2-D mesh only
        count = float(place.sum_over_data(torch.tensor([count], dtype=torch.float64))[0])
    return confidence_grid(adapter, total, count)


@dataclass
class ImportanceResult:
    """Importance (raw and normalised), confidence, and their rank agreement with ablation effects."""

    model: str
    loss: str
    n_examples: int
    importance: torch.Tensor  # (n_layers, H) E_x |dL/dxi|
    normalized: torch.Tensor  # (n_layers, H) each layer / its L2 norm
    confidence: torch.Tensor | None  # (n_layers, H) mean max attention weight
    seconds: float  # wall time of the importance pass (all batches, one backward each)
    correlations: dict[str, float | None] = field(default_factory=dict)  # Spearman, e.g. importance~ablation
    notes: list[str] = field(default_factory=list)

    def _repr_html_(self) -> str:
        """This result's page inline in a notebook (headlab's shell in a sandboxed frame; no network)."""
        from headlab.interpret import shell
        from headlab.interpret.heads.page import render_page

        return shell.inline(render_page(title=f"heads: {self.model}", importance=self))

    def ranking(self, ascending: bool = True) -> list[tuple[int, int]]:
        """(layer, head) by importance (ascending: the first to prune first)."""
        flat = [
            (float(self.importance[l, h]), l, h)
            for l in range(self.importance.shape[0])
            for h in range(self.importance.shape[1])
            if not torch.isnan(self.importance[l, h])
        ]
        flat.sort(reverse=not ascending)
        return [(l, h) for _, l, h in flat]

    def to_json(self) -> dict:
        """The result in headlab's envelope (kind ``head_importance``) beside the keys files have always had;
        NaN (a layer's missing heads) is written as null."""

        def grid(t):
            return None if t is None else [[C.safe_float(x) for x in row] for row in t.tolist()]

        return envelope(
            "head_importance",
            {
                "kind": "head_importance",
                "model": self.model,
                "loss": self.loss,
                "n_examples": self.n_examples,
                "importance": grid(self.importance),
                "normalized": grid(self.normalized),
                "confidence": grid(self.confidence),
                "seconds": self.seconds,
                "correlations": self.correlations,
                "notes": self.notes,
            },
            model=self.model,
            settings={"loss": self.loss},
        )

    @classmethod
    def from_json(cls, d: dict) -> ImportanceResult:
        """The result from its JSON: this version's envelope or an earlier file (the same keys, no header)."""

        def grid(x):
            return (
                None
                if x is None
                else torch.tensor([[float("nan") if v is None else v for v in row] for row in x], dtype=torch.float32)
            )

        try:
            return cls(
                d["model"],
                d["loss"],
                int(d["n_examples"]),
                grid(d["importance"]),
                grid(d["normalized"]),
                grid(d.get("confidence")),
                float(d.get("seconds", 0.0)),
                dict(d.get("correlations", {})),
                list(d.get("notes", [])),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(
                f"not an importance result (headlab heads importance's importance.json): {type(e).__name__} {e}"
            ) from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_json` to ``path`` (atomically, :func:`headlab.results.write_json`)."""
        return write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ImportanceResult:
        """An importance result saved by :meth:`save` or ``headlab heads importance --out`` (earlier files too)."""
        return cls.from_json(read_json(path, what="an importance.json (headlab heads importance --out)"))


def correlate(**grids: torch.Tensor | None) -> dict[str, float | None]:
    """Spearman rank correlation of every pair of ``(n_layers, H)`` grids, over the heads all of them have."""
    named = {k: v for k, v in grids.items() if v is not None}
    out: dict[str, float | None] = {}
    keys = list(named)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            x, y = named[a].flatten(), named[b].flatten()
            ok = ~(torch.isnan(x) | torch.isnan(y))
            out[f"{a}~{b}"] = C.spearman(x[ok].tolist(), y[ok].tolist()) if int(ok.sum()) > 2 else None
    return out


def importance_study(
    loaded,
    texts,
    labels=None,
    *,
    loss: C.Loss = "auto",
    batch_size: int = 16,
    backend: str = "auto",
    seed: int = 0,
    confidence: bool = True,
    single_effects=None,
    max_length: int | None = None,
    progress: bool | Progress = False,
) -> ImportanceResult:
    """Importance, normalised importance, confidence, and Spearman correlations between them and
    ``single_effects`` (an ``(n_layers, H)`` grid from :func:`headlab.ablate`), when given.

    The run of ``headlab heads importance`` (the instrument ``heads-importance`` through
    :func:`headlab.interpret.study.runner.call`): one unit per batch, each adding its importance and confidence
    sums; under torchrun every rank returns the whole result (see :func:`head_importance`)."""
    return _study(
        loaded,
        texts,
        labels,
        loss=loss,
        batch_size=batch_size,
        backend=backend,
        seed=seed,
        confidence=confidence,
        single_effects=single_effects,
        max_length=max_length,
        progress=progress,
    )


def study_result(
    loaded,
    imp: torch.Tensor,
    used: str,
    n: int,
    seconds: float,
    conf: torch.Tensor | None,
    single_effects: torch.Tensor | None = None,
) -> ImportanceResult:
    """:func:`importance_study`'s result from the raw importance grid and the confidence (or None)."""
    norms = torch.nan_to_num(imp).norm(dim=-1, keepdim=True).clamp_min(1e-20)
    adapter, ld = resolve(loaded)
    name = ld.name if ld is not None else type(adapter.model).__name__
    notes = []
    if used in ("kl", "cosine"):
        notes.append(
            f"loss={used}: its derivative is zero at the unpruned model; importance uses the first-order "
            "surrogate whose squared derivative estimates its curvature (see headlab.head_importance)"
        )
    return ImportanceResult(
        name,
        used,
        n,
        imp,
        imp / norms,
        conf,
        seconds,
        correlate(importance=imp, confidence=conf, ablation=single_effects),
        notes,
    )
