"""The corpus study: every method over a labelled dataset, Jain and Wallace's tables, ERASER faithfulness.

    result = study(loaded_or_path, "validation.tsv", "out/")     # see :func:`study`

Per instance (:func:`instance`, one record per row, kept in ``out/instances.json`` under ``"units"`` by the
row's key): the tokens, label, prediction, every method's scores, Kendall tau (and p) of attention with each
other method, the completeness gap, the permutation test, the adversarial-attention search
(:mod:`.counterfactual`) and the ERASER measures (:mod:`.faithfulness`). The corpus tables (:mod:`.tables`)
are computed from those records and written to ``out/study.json``, with figures (``tau_hist.png``,
``permutation.png``, ``adversarial.png``).

The rows are the units of the ``explain`` instrument (``headlab explain --dataset``): its runner splits them
over torchrun's ranks, keeps the finished ones on Ctrl-C (in ``instances.json``, the same file) and resumes
from them with ``--resume``. :func:`study` runs that instrument through the runner
(:func:`headlab.interpret.study.runner.call`), with its :class:`StudyOptions`, without a resume.

The dataset is a TSV file with a header: a text column (``sentence`` or ``text``) and a ``label``
column (an integer class). It is checked completely before the first model call.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from headlab.errors import InputError
from headlab.interpret.saliency.counterfactual import adversarial_attention, permutation_test
from headlab.interpret.saliency.explanation import DEFAULT_METHODS, explanation
from headlab.interpret.saliency.faithfulness import eraser
from headlab.interpret.saliency.objective import make_objective
from headlab.progress import Progress
from headlab.results import Result, envelope, write_json
from headlab.tsv import TEXT_COLUMNS, Row, read_dataset  # noqa: F401  (public here too)

INSTANCES = "instances.json"  # the records by row key: the explain instrument's units file


@dataclass
class StudyOptions:
    """How the study runs (all but ``limit`` recorded with the results)."""

    methods: tuple = DEFAULT_METHODS  # attention_flow is known but not a default (slow on long inputs)
    ig_steps: int = 50
    backend: str = "auto"
    loo: str = "delete"
    permutations: int = 100  # Jain and Wallace's count
    adversarial_steps: int = 20  # Adam steps of the adversarial search
    adversarial_restarts: int = 2  # rows searched in parallel
    tvd_budget: float = 0.01  # the output change an adversarial row may cause
    bootstrap: int = 1000  # resamples for the confidence intervals
    seed: int = 0
    counterfactual: bool = True  # run the permutation and adversarial tests

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class StudyResult:
    """The corpus tables (see :mod:`.tables`) and where the files are."""

    tables: dict
    out: Path
    instances: int
    skipped: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return envelope(
            "saliency_study",
            {
                "instances": self.instances,
                "out": str(self.out),
                "skipped": self.skipped,
                "files": self.files,
                **self.tables,
            },
            model=self.tables.get("model"),
            settings=self.tables.get("options"),
        )


def instance(loaded, row: Row, opts: StudyOptions) -> dict:
    """Everything measured on one row (a JSON-ready dict)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gap is recorded per instance and summarised
        ex = explanation(
            loaded,
            row.text,
            methods=opts.methods,
            ig_steps=opts.ig_steps,
            backend=opts.backend,
            loo=opts.loo,
            warn=False,
        )
    agr = ex.agreement()
    rec = {
        "key": row.key,
        "line": row.line,
        "label": row.label,
        "pred": ex.target,
        "probs": ex.probs,
        "tokens": ex.tokens,
        "special": ex.special,
        "scores": ex.scores,
        "completeness_gap": ex.completeness_gap,
        "tau": {f"{p.a}|{p.b}": [p.kendall_tau, p.kendall_p] for p in agr.pairs.values()},
    }
    enc = loaded.encode(row.text)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    adapter = loaded.adapter
    with adapter.use_backend(opts.backend):
        obj, _ = make_objective(loaded, enc, ex.target, None)
        rec["eraser"] = {
            m: f.to_json() for m, f in eraser(obj, ids, mask, ex.special, ex.scores, seed=opts.seed + row.line).items()
        }
        if opts.counterfactual and ex.attention_layers is not None:
            row_att = ex.attention_layers[-1].to(ids.device)  # (H, L)
            perm = permutation_test(obj, ids, mask, row_att, n=opts.permutations, seed=opts.seed + row.line)
            rec["permutation"] = {"median_tvd": perm.median_tvd, "max_attention": perm.max_attention}
            adv = adversarial_attention(
                obj,
                ids,
                mask,
                row_att,
                budget=opts.tvd_budget,
                steps=opts.adversarial_steps,
                restarts=opts.adversarial_restarts,
                seed=opts.seed + row.line,
            )
            rec["adversarial"] = {"max_jsd": adv.max_jsd, "tvd": adv.tvd}
    return _clean(rec)


def _clean(x):
    if isinstance(x, float):
        return x if x == x and x not in (float("inf"), float("-inf")) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def row_value(loaded, row: Row, opts: StudyOptions) -> dict:
    """One row's value (a unit of the ``explain`` instrument): its :func:`instance` record, or
    ``{"key", "line", "skipped": why}`` when the model refuses the row (a sentence longer than its positions)."""
    try:
        return instance(loaded, row, opts)
    except InputError as e:
        return {"key": row.key, "line": row.line, "skipped": f"line {row.line}: {e}"}


def conclude(
    loaded,
    dataset,
    out: Path,
    values: list[dict],
    opts: StudyOptions,
    skipped: list[str] | None = None,
    *,
    figures: bool = True,
    settings: dict | None = None,
) -> StudyResult:
    """The corpus tables from the rows' values (in the dataset's order), written to ``out``: the records to
    ``instances.json`` (the ``explain`` instrument's units file: a result envelope whose ``"units"`` hold each
    row's value by its key), ``study.json`` and the figures. ``skipped``: more lines for the result's
    ``skipped`` (a time budget); ``settings``: those the records were made with (the instrument's options)."""
    from headlab.interpret.saliency.tables import summarize

    records = [v for v in values if "skipped" not in v and "not_run" not in v]
    tables = summarize(records, opts)
    tables["options"] = opts.to_json()
    tables["model"] = loaded.name
    tables["dataset"] = str(dataset)
    out.mkdir(parents=True, exist_ok=True)
    kept = [v for v in values if "not_run" not in v]  # a row the time budget left out is not kept: a resume runs it
    Result(
        "explain",
        model=loaded.name,
        settings=settings if settings is not None else {**opts.to_json(), "dataset": str(dataset)},
        figures={"units": {v["key"]: v for v in kept}},
    ).save(out / INSTANCES)
    files = [INSTANCES, "study.json"]
    if figures and records:
        from headlab.interpret.saliency.figures import study_figures

        files += study_figures(records, tables, out)
    result = StudyResult(
        tables, out, len(records), [v["skipped"] for v in values if "skipped" in v] + list(skipped or []), files
    )
    write_json(out / "study.json", result.to_json(), indent=2)
    return result


def study(
    loaded_or_path,
    dataset: str | os.PathLike,
    out: str | os.PathLike,
    *,
    limit: int | None = None,
    options: StudyOptions | None = None,
    progress: bool | Progress = True,
    figures: bool = True,
    max_seconds: float | None = None,
) -> StudyResult | None:
    """Run the study (see the module docstring) and return the corpus tables.

    The rows are the ``explain`` instrument's units, run by the study runner
    (:func:`headlab.interpret.study.runner.call`): its checks, load, progress (the ``explain`` stage, a row at a
    time), rank split and recording, as ``headlab explain --dataset`` has them.

    Args:
        loaded_or_path: a LoadedModel or a model name/folder (a classifier; decoders explain their next token).
        dataset: TSV with columns ``sentence`` (or ``text``) and ``label``.
        out: folder for ``instances.json``, ``study.json`` and the figures (created; files of an earlier study
            in it are replaced).
        limit: only the first ``limit`` rows.
        options: :class:`StudyOptions`.
        progress: a bar on stderr (True), nothing (False) or ``progress(stage, done, total)``
            (:mod:`headlab.progress`); only rank 0 reports.
        max_seconds: stop starting new instances after this long (the tables cover what is done). The
            result's ``skipped`` says how many rows were left.

    A run to interrupt and resume is the ``explain`` instrument's, whose units are the rows:
    ``headlab explain --dataset ... --out DIR`` (Ctrl-C keeps the finished rows, ``--resume`` runs the rest), or
    ``headlab.interpret.study.runner.run("explain", {...}, resume=True)`` from Python.

    Data-parallel under ``torchrun`` (a process group from :func:`headlab.distributed.data.init_from_env`):
    each rank explains every W-th row, rank 0 gathers the records, writes them and the tables and
    returns the result; the other ranks return None. On a model sharded by tensor parallelism the ranks of
    a tensor-parallel group explain the same rows together (a 2-D mesh: the groups split the rows).
    """
    from headlab.interpret.study import runner

    opts = options or StudyOptions()
    study_options = {
        "model": Path(loaded_or_path) if isinstance(loaded_or_path, os.PathLike) else loaded_or_path,
        "dataset": dataset,
        "out": out,
        "force": True,  # the files of an earlier study in ``out`` are replaced
        "limit": limit,
        "methods": opts.methods,
        "ig_steps": opts.ig_steps,
        "backend": opts.backend,
        "loo": opts.loo,
        "no_counterfactual": not opts.counterfactual,
        "study_options": opts,
        "max_seconds": max_seconds,
        "figures": figures,
    }
    from headlab.distributed.placement import Placement

    result = runner.call("explain", study_options, progress=progress)
    return result if Placement.here().rank == 0 else None  # rank 0 wrote the study: the others return None
