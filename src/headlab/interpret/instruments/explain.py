"""``explain``: attention against saliency for one prediction, or the corpus study over a dataset, as an instrument.

The computations are the saliency room's: :func:`~headlab.interpret.saliency.explanation.explanation` for one
text (attention, gradient, grad x input, integrated gradients, leave-one-out, rollout, norm-based rollout,
attention flow, the norm map, and their agreement) and the corpus study's rows for ``--dataset`` (Jain and
Wallace's corpus tables and the ERASER measures). This file declares the options of ``headlab explain`` and
checks them before the model loads; its view (:mod:`headlab.cli.views.explain`) shows the result. The library's
:func:`~headlab.interpret.saliency.explain` and :func:`~headlab.interpret.saliency.study` run this instrument
through :func:`headlab.interpret.study.runner.call`, with settings of their own (``python`` options: IG's
quadrature, the study's :class:`~headlab.interpret.saliency.StudyOptions`, its budget in seconds, its figures).

**One text** is one unit; its page, PNG and JSON go to ``--out`` (a new or empty folder, or ``--force``).

**The study**: every dataset row is a unit (keyed ``line:sha1`` of its text), whose value is the row's record
(:func:`~headlab.interpret.saliency.corpus_study.row_value`); ``finish`` makes the corpus tables from them
(:func:`~headlab.interpret.saliency.corpus_study.conclude`, what :func:`~headlab.interpret.saliency.study`
computes). The runner does the rest: the ``explain`` stage on its display, the rows split over torchrun's ranks
(on a model sharded by heads, over the tensor-parallel groups) and gathered on rank 0, and on Ctrl-C the
finished rows kept in ``OUT/instances.json`` (the result file: the records under ``"units"``), from which
``--resume`` runs only the rest. ``--max-minutes`` stops starting rows: those left are not kept, so a
``--resume`` explains them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from headlab.errors import ConfigError, InputError
from headlab.interpret.saliency.explanation import DEFAULT_METHODS, METHODS
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


def _budget(options: dict) -> float | None:
    """The study's time budget in seconds: ``max_seconds`` (from Python), else ``--max-minutes``, else None."""
    if options["max_seconds"] is not None:
        return float(options["max_seconds"])
    return None if options["max_minutes"] is None else 60 * options["max_minutes"]


STUDY_ONLY = (("limit", "--limit"), ("max_minutes", "--max-minutes"), ("no_counterfactual", "--no-counterfactual"))


def _ig_steps(value, option: Option, options: dict) -> None:
    from headlab.interpret.saliency.integrated import MAX_STEPS

    if isinstance(value, int) and value > MAX_STEPS:  # below 1 (or not a number): the library's own check says so
        raise ConfigError(
            f"{option.label} must be at most {MAX_STEPS:,} (Gauss-Legendre converges in tens of steps; 50 "
            f"is the usual choice), got {value:,}"
        )


@register
class Explain(Instrument):
    """Attention versus saliency for one prediction (or over a dataset), with their agreement."""

    name = "explain"
    summary = """Attention versus gradient, grad x input, integrated gradients and leave-one-out (Jain and Wallace 2019),
rollout, norm-based rollout, attention flow and the norm map (Abnar and Zuidema 2020; Kobayashi et al. 2020).

Examples: headlab explain "a gripping , funny film" --model ~/.cache/headlab/minilm-sst2 --out ex/
          headlab explain "a gripping , funny film" --model PATH --methods rollout,attention_flow,gradient
          headlab explain --dataset validation.tsv --model ~/.cache/headlab/minilm-sst2 --out study/
          torchrun --nproc-per-node 2 -m headlab explain --dataset validation.tsv --model PATH --out study/
          (data-parallel: each process explains every 2nd row; rank 0 writes the files and prints)"""
    options = (
        Option(
            "text",
            None,
            str,
            None,
            "the text whose prediction to explain (omit with --dataset)",
            metavar="TEXT",
            reads="text",
        ),
        Option(
            "model", "--model", str, REQUIRED, "a model folder (e.g. the SST-2 classifier) or known name", short="-m"
        ),
        Option(
            "methods",
            "--methods",
            str,
            ",".join(DEFAULT_METHODS),
            "comma-separated, of: " + ", ".join(METHODS) + " (default: all but attention_flow)",
        ),
        Option("target", "--target", int, None, "class (or next-token id) to explain; default the prediction"),
        Option("ig_steps", "--ig-steps", int, 50, "integrated-gradients steps", check=_ig_steps),
        Option("backend", "--backend", str, "auto", "attention backend for every pass (sdpa, tiled, ...)"),
        Option("loo", "--loo", str, "delete", "leave-one-out: delete, mask or unk"),
        Option(
            "compare_to",
            "--compare-to",
            str,
            None,
            "for a model with no head: explain cosine similarity to this text",
            reads="text",
        ),
        Option("truncate", "--truncate", bool, False, "cut text longer than the model's positions (warned)"),
        Option("dataset", "--dataset", Path, None, "TSV (sentence, label): run the corpus study instead"),
        Option("limit", "--limit", int, None, "with --dataset: only the first N rows", setting=False),
        Option(
            "no_counterfactual",
            "--no-counterfactual",
            bool,
            False,
            "with --dataset: skip permutation and adversarial tests",
        ),
        Option(
            "max_minutes",
            "--max-minutes",
            float,
            None,
            "with --dataset: stop starting new rows after this long (--resume runs the rest)",
            setting=False,
        ),
        Option(
            "out",
            "--out",
            Path,
            None,
            "folder for the HTML page + PNG (or the study's files)",
            short="-o",
            setting=False,
        ),
        Option(
            "force",
            "--force",
            bool,
            False,
            "write into a non-empty --out folder (a study starts again; --resume continues it)",
            setting=False,
        ),
        Option("as_json", "--json", bool, False, "print the result as JSON", setting=False),
        # from Python only: headlab.explain's settings of integrated gradients and the attention rows
        Option("ig_method", None, str, "gausslegendre", "IG's quadrature", setting=False, python=True),
        Option("ig_batch_size", None, int, None, "IG's points per forward pass", setting=False, python=True),
        Option("attention_layers", None, str, "auto", "all, last or auto", setting=False, python=True),
        Option("warn", None, bool, True, "a CompletenessWarning above a 1% gap", setting=False, python=True),
        # from Python only: headlab.interpret.saliency.study's StudyOptions, its time budget and figures
        Option("study_options", None, object, None, "the study's StudyOptions", setting=False, python=True),
        Option("max_seconds", None, float, None, "stop starting rows after this long", setting=False, python=True),
        Option("figures", None, bool, True, "the study's figures (PNG)", setting=False, python=True),
    )
    # the study's units are kept in OUT/instances.json (its records); one text writes its page beside
    output = Output("out", folder=True, file="instances.json", force="force")
    resumable = True  # --resume: the study's rows already in OUT/instances.json are kept
    stage = "explain"
    reads_text = True  # a model folder without a tokenizer is refused before the load

    def resumes(self, ctx: Context) -> bool:
        """Only the corpus study keeps units (its rows); one explanation has nothing to resume."""
        return ctx.options["dataset"] is not None

    def load(self, ctx: Context):
        """The model by name or folder, or (from Python) a :class:`~headlab.models.loader.LoadedModel` as is; any
        other object is refused as :func:`~headlab.interpret.saliency.explain` has always refused it."""
        from headlab.interpret.saliency.explanation import resolve_model

        return (
            super().load(ctx) if isinstance(ctx.options["model"], str | Path) else resolve_model(ctx.options["model"])
        )

    def check(self, ctx: Context) -> None:
        """The options alone, in the order the command has always checked them (from Python: the library's checks,
        in its words: a target out of range, a limit, are the library's to refuse)."""
        o = ctx.options
        if ctx.python:
            if o["dataset"] is None and not isinstance(o["text"], str):  # before the runner reads it
                raise InputError(f"text must be a string, got {type(o['text']).__name__}")
            return
        if o["target"] is not None:
            at_least(0, " (a class or token id)")(o["target"], self.option("target"), o)
        if o["dataset"] is None:  # the study's options would be ignored silently
            alone = [flag for name, flag in STUDY_ONLY if o[name] is not None and o[name] is not False]
            if alone:
                raise InputError(
                    f"{', '.join(alone)}: {'it acts' if len(alone) == 1 else 'they act'} only with "
                    "--dataset FILE.tsv (the corpus study); drop it, or add --dataset"
                )
            if o["text"] is None:
                raise InputError("no text: give TEXT to explain, or --dataset FILE.tsv with --out DIR")
            return
        if o["text"] is not None:
            raise InputError("give either TEXT or --dataset, not both")
        if o["out"] is None:
            raise InputError("--dataset needs --out DIR (where the per-instance lines and tables go; reruns resume)")
        if o["limit"] is not None:
            at_least(1, " row")(o["limit"], self.option("limit"), o)
        if o["max_minutes"] is not None and not 0 < o["max_minutes"] < math.inf:
            raise ConfigError(f"--max-minutes must be a number > 0, got {o['max_minutes']}")

    def prepare(self, ctx: Context) -> None:
        """Before the load: the dataset file (not UTF-8, empty, no label column), then the methods and their
        settings, as :func:`~headlab.interpret.saliency.study` and :func:`~headlab.interpret.saliency.explain`
        check them."""
        from headlab.interpret.saliency.explanation import check_options

        o = ctx.options
        if o["dataset"] is not None and Path(o["dataset"]).is_file() and not ctx.python:
            from headlab.reading import read_file

            read_file(
                Path(o["dataset"]), "--dataset", "texts", what="a TSV file with a header row (columns sentence, label)"
            )
        methods = check_options(o["methods"], o["ig_steps"], o["backend"], o["loo"])
        if o["dataset"] is not None:
            from headlab.interpret.saliency import StudyOptions
            from headlab.tsv import read_dataset

            ctx.state["rows"] = read_dataset(o["dataset"], o["limit"])  # a missing column stops here
            given = o["study_options"]  # from Python: the library's StudyOptions (their methods checked above)
            ctx.state["study"] = (
                dataclasses.replace(given, methods=tuple(methods))
                if given is not None
                else StudyOptions(
                    methods=tuple(methods),
                    ig_steps=o["ig_steps"],
                    backend=o["backend"],
                    loo=o["loo"],
                    counterfactual=not o["no_counterfactual"],
                )
            )

    def check_loaded(self, ctx: Context) -> None:
        ctx.state["t0"] = time.perf_counter()  # --max-minutes counts from here

    def units(self, ctx: Context) -> list[Unit]:
        """One text: one unit; the study: one per dataset row, keyed by its line and text."""
        if ctx.options["dataset"] is None:
            return [Unit(self.name)]
        return [Unit(row.key, row) for row in ctx.state["rows"]]

    def run_unit(self, ctx: Context, unit, recording=None):
        o = ctx.options
        if o["dataset"] is None:
            from headlab.interpret.saliency.explanation import explanation

            return explanation(
                ctx.loaded,
                ctx.data["text"],
                target=o["target"],
                methods=o["methods"],
                ig_steps=o["ig_steps"],
                backend=o["backend"],
                loo=o["loo"],
                compare_to=ctx.data.get("compare_to"),
                truncate=o["truncate"],
                ig_method=o["ig_method"],
                ig_batch_size=o["ig_batch_size"],
                attention_layers=o["attention_layers"],
                warn=o["warn"],
            )
        from headlab.interpret.saliency import corpus_study

        row = unit.payload
        if self._over_budget(ctx):
            value = {"key": row.key, "line": row.line, "not_run": True}
        else:
            value = corpus_study.row_value(ctx.loaded, row, ctx.state["study"])
        return value

    @staticmethod
    def _over_budget(ctx: Context) -> bool:
        """--max-minutes spent; the ranks of a tensor-parallel group agree (they run each row together)."""
        budget = _budget(ctx.options)
        over = budget is not None and time.perf_counter() - ctx.state["t0"] > budget
        place = ctx.loaded.adapter.placement
        if budget is not None and place.sharded:
            import torch

            over = bool(place.sum_group(torch.tensor([float(over)], dtype=torch.float64))[0] > 0)
        return over

    def unit_to_json(self, value):
        return value.to_json() if hasattr(value, "to_json") else value  # one text's Explanation; a row's record

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        o = ctx.options
        if o["dataset"] is None:
            return InstrumentResult.of(values[self.name])
        from headlab.interpret.saliency.corpus_study import conclude

        rows = list(values.values())  # in the dataset's order
        left = sum("not_run" in v for v in rows)
        again = "" if ctx.python else " yet (run again with --resume to explain them)"
        skipped = (
            [f"time budget of {_budget(o):.0f} s reached: {left} of {len(rows)} rows not run{again}"] if left else []
        )
        settings = ctx.settings
        if ctx.python:  # the library's study records its StudyOptions (and the rows it took) as its settings
            settings = {**ctx.state["study"].to_json(), "dataset": str(o["dataset"]), "limit": o["limit"]}
        study = conclude(
            ctx.loaded,
            o["dataset"],
            Path(o["out"]).expanduser(),
            rows,
            ctx.state["study"],
            skipped,
            figures=o["figures"],
            settings=settings,
        )
        return InstrumentResult.of(study)

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        if ctx.options["dataset"] is not None:  # finish wrote the records, the tables and the figures
            return [path.parent / f for f in result.native.files]
        from headlab.interpret.saliency.html import write_explanation

        ctx.state["paths"] = paths = write_explanation(result.native, path.parent)  # path: OUT/instances.json
        return list(paths.values())


__all__ = ["Explain"]
