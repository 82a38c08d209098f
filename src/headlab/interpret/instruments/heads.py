"""``heads importance`` and ``heads ablate``: which heads matter, as instruments.

The computations are the heads room's (:func:`~headlab.interpret.heads.importance.importance_study`,
:func:`~headlab.interpret.heads.ablation.ablate`), cut into the runner's units by
:mod:`headlab.interpret.heads.units`: importance is one unit per batch of examples (its sums; under torchrun the
runner splits the batches across the data ranks and gathers them on rank 0, which adds them), the ablation one
unit per batch for the single and keep-one configurations, then one per batch for the pairs, then the CKA
(``chained``: the pairs are chosen from every single effect). Both keep their finished units on Ctrl-C and go on
with ``--resume``. ``--data`` is read by :mod:`headlab.reading` as its suffix says (``.tsv`` a dataset with a
``sentence`` or ``text`` column and an optional ``label``, ``.conllu`` the ``# text =`` of each sentence,
anything else one text per line), before the model loads. Both report on the runner's display: its "loading
model" step, then the batches done. The library's functions run them too (:func:`headlab.head_importance`,
:func:`~headlab.interpret.heads.importance.importance_study`, :func:`headlab.ablate`, through
:func:`~headlab.interpret.study.runner.call`): their texts in memory and their settings (``seed``, ``max_length``,
``single_effects``, ``alpha``, ...) are Python-only options, which the command line has no flag for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from headlab.errors import ConfigError, InputError
from headlab.interpret.study.base import (
    REQUIRED,
    Context,
    Instrument,
    InstrumentResult,
    Option,
    Output,
    Unit,
    at_least,
    register,
)


def read_examples(path, option: str = "--data", *, limit: int | None = None) -> tuple[list[str], list[int] | None]:
    """``(texts, labels or None)`` of a ``.tsv``, ``.conllu`` or plain-text file (the first ``limit``): the heads
    room's :func:`~headlab.interpret.heads.examples.read_texts`, which reads through :mod:`headlab.reading`."""
    from headlab.interpret.heads.examples import read_texts

    return read_texts(path, limit=limit, option=option)


def _check_loss(value, option, options) -> None:
    from headlab.interpret.heads.examples import LOSSES

    if value not in (*LOSSES, "auto"):
        raise ConfigError(f"{option.label} {value!r} is not a loss; use one of {' | '.join(LOSSES)} | auto")


def _check_backend(value, option, options) -> None:
    from headlab.attention import backends

    if value != "auto" and value not in backends.names():
        raise ConfigError(
            f"{option.label} {value!r} is not a backend; use auto or one of {', '.join(backends.names())}"
        )


def _check_single_effects(value, option, options) -> None:
    import torch

    if not isinstance(value, torch.Tensor):
        raise ConfigError("single_effects must be an (n_layers, H) tensor, e.g. ablate(...).single")


MODEL = Option("model", "--model", str, REQUIRED, "a known model name or a local model folder", short="-m")
DATA = Option(
    "data", "--data", Path, None, ".tsv (sentence[, label] header), .conllu (# text = lines) or .txt", short="-d"
)
LOSS = Option("loss", "--loss", str, "auto", "task | lm | kl | cosine | auto", check=_check_loss)
OUT = Option("out", "--out", Path, None, "folder for the JSON result and the HTML page", short="-o", setting=False)
LIMIT = Option("limit", "--limit", int, None, "use only the first N examples", check=at_least(1, " example"))
BATCH = Option("batch_size", "--batch-size", int, 16, "examples per forward (and backward)", check=at_least(1))
BACKEND = Option("backend", "--backend", str, "auto", check=_check_backend)
JSON = Option("as_json", "--json", bool, False, "print the result as JSON", setting=False)
# from Python only (headlab.head_importance, headlab.ablate, ...): the examples in memory, and the library's settings
TEXTS = Option("texts", None, list, None, "the examples in memory: strings or token ids", python=True, setting=False)
LABELS = Option("labels", None, list, None, "gold class ids of the texts (loss 'task')", python=True, setting=False)
SEED = Option("seed", None, int, 0, "the draws (label-free surrogates; bootstrap)", python=True)
MAX_LENGTH = Option("max_length", None, int, None, "tokens kept per text", python=True, check=at_least(1))


class _HeadStudy(Instrument):
    """What both studies share: --data read before the load, token ids for a model without a tokenizer."""

    file = ""  # the result file in --out
    resumable = True  # the units are kept in the result file: --resume finishes an interrupted run
    stage = "batches"
    envelope: Callable[[Any], dict]  # each study's own: its result's JSON document
    result: Callable[[Context, dict], Any]  # each study's own: its result from the units' values

    def check(self, ctx: Context) -> None:
        o = ctx.options
        if o["data"] is not None and (o["texts"] is not None or o["labels"] is not None):
            raise ConfigError("give the examples as data (a file) or as texts (in memory), not both")
        if o["data"] is None and not ctx.python:  # a library function hands its texts over (none: no examples)
            raise InputError("--data FILE is required: a .tsv, .conllu or .txt of examples")

    def prepare(self, ctx: Context) -> None:
        o = ctx.options
        if o["data"] is None:  # from Python: the texts and labels in memory, as given
            ctx.data["texts"], ctx.data["labels"] = o["texts"], o["labels"]
        else:
            ctx.data["texts"], ctx.data["labels"] = read_examples(o["data"], limit=o["limit"])

    def examples(self, ctx: Context) -> list:
        from headlab.interpret.heads.examples import token_ids_if_needed

        if ctx.options["data"] is None:  # in memory: the library takes them as they are
            return ctx.data["texts"]
        return token_ids_if_needed(ctx.loaded, ctx.data["texts"])

    def units(self, ctx: Context) -> list[Unit]:
        return [Unit(k) for k in ctx.state["work"].keys()]

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        r = self.result(ctx, values)
        return InstrumentResult.of(r, self.envelope(r))


@register
class HeadImportance(_HeadStudy):
    """Michel et al.'s importance of every head, and Voita's confidence."""

    name = "heads-importance"
    command = "heads importance"
    kind = "head_importance"
    summary = """Michel et al.'s importance E|dL/dxi| of every head (one backward per batch), and confidence.

Data-parallel with torchrun: `torchrun --nproc-per-node 2 -m headlab heads importance ...` splits the
batches across the processes and adds their sums; rank 0 shows the progress and writes the output."""
    options = (
        MODEL,
        DATA,
        LOSS,
        OUT,
        LIMIT,
        BATCH,
        BACKEND,
        Option(
            "confidence",
            "--confidence",
            bool,
            True,
            "also Voita's confidence (streaming statistics)",
            off="--no-confidence",
        ),
        JSON,
        TEXTS,
        LABELS,
        SEED,
        MAX_LENGTH,
        Option(
            "single_effects",
            None,
            object,
            None,
            "an ablation's single effects (n_layers, H): their rank correlations with importance and confidence",
            check=_check_single_effects,
            python=True,
            setting=False,
        ),
    )
    output = Output("out", folder=True, file="importance.json", allow_existing=True, replace=True)

    def check_loaded(self, ctx: Context) -> None:
        from headlab.interpret.heads.units import ImportanceUnits

        o = ctx.options
        ctx.state["work"] = ImportanceUnits(
            ctx.loaded,
            self.examples(ctx),
            ctx.data["labels"],
            loss=o["loss"],
            batch_size=o["batch_size"],
            backend=o["backend"],
            seed=o["seed"],
            confidence=o["confidence"],
            max_length=o["max_length"],
        )

    def run_unit(self, ctx: Context, unit, recording=None):
        i = int(unit.key.split()[-1])
        return ctx.state["work"].run(i, ctx.kept.get(f"batch {i - 1}"))

    def unit_to_json(self, value):
        from headlab.interpret.heads.units import ImportanceUnits

        return ImportanceUnits.unit_to_json(value)

    def unit_from_json(self, data):
        from headlab.interpret.heads.units import ImportanceUnits

        return ImportanceUnits.unit_from_json(data)

    def result(self, ctx: Context, values: dict):
        work = ctx.state["work"]
        for v in values.values():  # the generator's states are for resuming an unfinished run: a finished one
            v["rng"] = None  # keeps its sums alone
        return work.finish([values[k] for k in work.keys()], single_effects=ctx.options["single_effects"])

    def envelope(self, r) -> dict:
        from headlab.results import envelope

        return envelope("head_importance", r.to_json(), model=r.model, settings={"loss": r.loss})

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        from headlab.interpret.heads.page import render_page
        from headlab.results import write_json

        r = result.native
        files = [write_json(path, result.to_json()), path.parent / "heads.html"]
        files[1].write_text(render_page(title=f"head importance: {r.model}", importance=r))
        return files


def _check_kind(value, option, options) -> None:
    from headlab.interpret.heads.edits import KINDS

    if value not in KINDS:
        if option.flag is None:  # from Python (headlab.ablate): the library's words
            raise ConfigError(f"unknown ablation kind {value!r}; use one of {', '.join(KINDS)}")
        raise ConfigError(f"--kind {value!r} is not an ablation kind; use one of {', '.join(KINDS)}")


def _check_k(value, option, options) -> None:
    from headlab.interpret.heads.ablation_plan import check_k

    if option.flag is None:  # from Python (headlab.ablate): the library's check
        check_k(value)
    else:
        at_least(0)(value, option, options)


def _check_boot(value, option, options) -> None:
    from headlab.interpret.heads.ablation_stats import check_bootstrap

    check_bootstrap(value, options.get("alpha", 0.05))


def _python(name: str, type_: type, default, help: str, **kw) -> Option:
    """An option only :func:`headlab.ablate` gives (a library setting; the command line has no flag for it)."""
    return Option(name, None, type_, default, help, python=True, **kw)


@register
class HeadAblation(_HeadStudy):
    """Single, pair and keep-one ablation effects with intervals, and each head's verdict."""

    name = "heads-ablate"
    command = "heads ablate"
    kind = "head_ablation"
    summary = "Single, pair and keep-one ablation effects with intervals, and the verdicts unused / redundant / unique."
    options = (
        MODEL,
        DATA,
        LOSS,
        OUT,
        LIMIT,
        BATCH,
        Option("kind", "--kind", str, "zero", "zero | mean | resample | uniform", check=_check_kind),
        Option("k", "--k", int, 16, "pairs among the k lowest single effects", check=_check_k),
        Option("boot", "--boot", int, 1000, "bootstrap resamples", check=_check_boot),
        Option("keep_one", "--keep-one", bool, True, "each layer reduced to one head", off="--no-keep-one"),
        BACKEND,
        JSON,
        TEXTS,
        LABELS,
        _python("heads", list, None, "(layer, head) pairs ablated singly (default: every head)"),
        _python("pairs", list, None, "((l, h), (l2, g)) pairs ablated jointly (default: among the k lowest)"),
        _python("mean_over", str, "token", "kind 'mean': one mean per head ('token') or per position"),
        _python("max_rows", int, 128, "rows per forward (configurations x examples)"),
        _python("alpha", float, 0.05, "the intervals' level (0.05: 95%)"),
        _python("rel_tol", float, 0.01, "the threshold's share of the scale (see headlab.ablate)"),
        _python("cka", bool, True, "the linear CKA of the pair heads' outputs"),
        _python("max_cka_tokens", int, 4096, "tokens per head the CKA reads at most"),
        SEED,
        MAX_LENGTH,
    )
    output = Output("out", folder=True, file="ablation.json", allow_existing=True, replace=True)

    chained = True  # the pairs are the k lowest of every single effect: the units run in order, on one data rank

    def check_loaded(self, ctx: Context) -> None:
        from headlab.interpret.heads.units import AblationUnits

        o = ctx.options
        ctx.state["work"] = AblationUnits(
            ctx.loaded,
            self.examples(ctx),
            ctx.data["labels"],
            kind=o["kind"],
            loss=o["loss"],
            k=o["k"],
            keep_one=o["keep_one"],
            batch_size=o["batch_size"],
            n_boot=o["boot"],
            backend=o["backend"],
            **{n: o[n] for n in ("heads", "pairs", "mean_over", "max_rows", "alpha", "rel_tol", "cka")},
            **{n: o[n] for n in ("max_cka_tokens", "seed", "max_length")},
        )

    def run_unit(self, ctx: Context, unit, recording=None):
        return ctx.state["work"].run(unit.key, ctx.kept)

    def unit_to_json(self, value):
        from headlab.interpret.heads.units import AblationUnits

        return AblationUnits.unit_to_json(value)

    def unit_from_json(self, data):
        from headlab.interpret.heads.units import AblationUnits

        return AblationUnits.unit_from_json(data)

    def result(self, ctx: Context, values: dict):
        return ctx.state["work"].finish(values)

    def envelope(self, r) -> dict:
        from headlab.results import envelope

        return envelope(
            "head_ablation",
            r.to_json(),
            model=r.model,
            settings={"kind": r.kind, "mean_over": r.mean_over, "loss": r.loss},
        )

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        from headlab.interpret.heads.page import render_page
        from headlab.results import write_json

        r = result.native
        files = [write_json(path, result.to_json()), path.parent / "heads.html"]
        files[1].write_text(render_page(title=f"head ablation: {r.model}", ablation=r))
        return files


__all__ = ["HeadAblation", "HeadImportance", "read_examples"]
