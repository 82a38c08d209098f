"""``analyze``: every attention head of a model on one text, as a report folder, as an instrument.

It lives in the report room, not beside the other instruments in :mod:`headlab.interpret.instruments`: the
report is the top room of ``interpret`` and nothing below it imports it (``tests/test_layers.py``), while this
class is the report job's row. Importing this module registers it (``headlab analyze`` does).

The computation is the report room's (:mod:`headlab.interpret.report.analyze_job`): :func:`plan` prepares the
job on the loaded model, the report's sections (:mod:`headlab.interpret.report.sections`) each declare the
capture sites they read, :func:`compute` turns one recording into every section's result, and
:func:`write_report` writes the folder (the sections' files, ``heads.csv``, ``heads.json``, ``report.html``).
:func:`~headlab.interpret.report.analyze_job.analyze` runs this instrument for library users, through
:func:`headlab.interpret.study.runner.call` (with two settings of its own, ``python`` options: the labels'
thresholds and the annotations in memory). Its view (:mod:`headlab.cli.views.analyze`) shows the summary.

**Record once.** :meth:`Analyze.sites` and :meth:`Analyze.stats` are the union of the active sections' sites and
statistics, so the study runner makes the one recording of the text and hands it to :meth:`Analyze.run_unit`;
:meth:`Analyze.capture_options` adds the job's backend and, for streaming mode's map-free statistics (longer
inputs), the sink positions (the first token and each [SEP]), as :func:`record_once` does.
A memory refusal of the full mode's recording says how to stream (:meth:`Analyze.recording_refused`).

One text is one unit: an interrupted run has no finished unit to keep (the runner says so). The unit's value is
the sections' results in memory. Under torchrun the runner gives the unit to the first data rank: with
``--tensor-parallel`` that is every rank of the group (its sharded forwards are collectives), and rank 0 writes.
``heads.json`` is the result's envelope; its notes include what the sections said while writing their files, so
:meth:`Analyze.write` completes the result's figures from the file it wrote.
"""

from __future__ import annotations

from pathlib import Path

from headlab.errors import ConfigError
from headlab.interpret.report.analyze_job import MAX_FULL_TOKENS
from headlab.interpret.study.base import REQUIRED, Context, Instrument, InstrumentResult, Option, Output, register


@register
class Analyze(Instrument):
    """Every head of a model on one text: per-layer pictures, an interactive page and a per-head table."""

    name = "analyze"
    reads_text = True  # a model folder without a tokenizer is refused before the load
    summary = """Write a report on every attention head: per-layer pictures, an interactive page, a per-head table.

Example: headlab analyze "The cat sat on the mat because it was tired." --out cat-report

TEXT must be valid UTF-8: other bytes (Latin-1 text, say) are refused with their position."""
    options = (
        Option("text", None, str, REQUIRED, "the text to analyse (quote it)", metavar="TEXT"),
        Option("model", "--model", str, "minilm", "a known model name (minilm) or a local model folder", short="-m"),
        Option(
            "out",
            "--out",
            Path,
            Path("headlab-report"),
            "report folder (must be new or empty)",
            short="-o",
            setting=False,
        ),
        Option("backend", "--backend", str, None, "attention backend the model runs on (headlab backends)"),
        Option(
            "force", "--force", bool, False, "write into a non-empty folder, replacing a previous report", setting=False
        ),
        Option("heads", "--heads", str, None, "heads to draw for long inputs, LAYER.HEAD,... e.g. 0.3,2.5"),
        Option(
            "max_full_tokens",
            "--max-full-tokens",
            int,
            MAX_FULL_TOKENS,
            "longer inputs use streaming statistics and draw only chosen heads",
        ),
        Option("truncate", "--truncate", bool, False, "cut text longer than the model's positions (warned)"),
        Option("probe", "--probe", Path, None, "label heads with a `headlab probe` result (relations.json)"),
        Option(
            "heads_result",
            "--heads-result",
            Path,
            None,
            "show importance and verdicts from `headlab heads` (importance.json, ablation.json)",
        ),
        Option("as_json", "--json", bool, False, "print the summary as JSON", setting=False),
        Option(
            "flow",
            "--flow",
            bool,
            False,
            "also write the norm maps and the rollout beside the page "
            "(norms_layer_*.png, rollout.png, rollout.json); the page always shows them",
        ),
        # from Python only (headlab.analyze): the labels' thresholds and other studies' findings in memory
        Option(
            "thresholds", None, object, None, "LabelThresholds (default: the usual ones)", setting=False, python=True
        ),
        Option("annotations", None, dict, None, "{(layer, head): text} shown per head", setting=False, python=True),
    )
    # the report folder; checked first in the report's own words by check(), then by the runner
    output = Output("out", folder=True, file=None, force="force")

    def check(self, ctx: Context) -> None:
        """The text, --heads (against the model's config files, no weights), the numbers, the backend and the
        folder, in the order and the words of the command before it was a row; nothing is read or made."""
        from headlab.interpret.heads.naming import check_heads_in_config
        from headlab.interpret.report.analyze_job import check_request
        from headlab.interpret.report.folder import check_out_dir
        from headlab.reading import check_utf8

        o = ctx.options
        if not ctx.python:  # from Python, a str is a str, and --heads is checked against the loaded model
            check_utf8(o["text"])
            check_heads_in_config(o["model"], o["heads"])
        check_request(o["text"], max_full_tokens=o["max_full_tokens"], backend=o["backend"])
        if o["out"] is None:
            raise ConfigError("--out is required: the report is a folder (it is created if missing)")
        check_out_dir(o["out"], force=o["force"])

    def prepare(self, ctx: Context) -> None:
        """The other studies' results (--probe, --heads-result) read, still before the load; the folder is checked,
        not made: a refusal after this (the load, the memory guard) leaves nothing behind (:meth:`write` makes it)."""
        from headlab.interpret.report.annotations import study_annotations
        from headlab.interpret.report.folder import check_out_dir

        o = ctx.options
        given = o["annotations"]  # from Python: the findings in memory
        ctx.state["annotations"] = (
            given if given is not None else study_annotations(probe=o["probe"], heads=o["heads_result"]) or None
        )
        ctx.state["out"] = check_out_dir(o["out"], force=o["force"])

    def check_loaded(self, ctx: Context) -> None:
        """The job on the model (--heads and the annotations against its heads, the text against its positions),
        its sections, and the step that says what the recording holds."""
        from headlab.interpret.heads.labels import LabelThresholds
        from headlab.interpret.report.analyze_job import mode_line, plan

        o = ctx.options
        job, sections, notes = plan(
            ctx.loaded,
            o["text"],
            ctx.state["out"],
            backend=o["backend"],
            max_full_tokens=o["max_full_tokens"],
            heads=o["heads"],
            truncate=o["truncate"],
            thresholds=o["thresholds"] or LabelThresholds(),
            annotations=ctx.state["annotations"],
            flow=o["flow"],
            say=lambda message: ctx.progress(message, 0, 0),
        )
        ctx.state.update(job=job, sections=sections, notes=notes)
        ctx.progress(mode_line(job), 0, 0)

    def sites(self, ctx: Context) -> list[str]:
        """The union of the active sections' sites: the runner records them once."""
        job = ctx.state["job"]
        return sorted({site for s in ctx.state["sections"] for site in s.sites(job)})

    def stats(self, ctx: Context) -> set[str]:
        """The map-free statistics the sections read (streaming mode's table)."""
        job = ctx.state["job"]
        return {st for s in ctx.state["sections"] for st in s.stats(job)}

    def capture_options(self, ctx: Context) -> dict:
        """The job's backend, and the statistics' sink positions (the first token and each [SEP])."""
        job = ctx.state["job"]
        return {"backend": job.backend, "stats_kwargs": {"key_positions": job.sinks}}

    def recording_refused(self, ctx: Context, error: Exception) -> Exception:
        """The full mode's memory refusal says how to stream instead."""
        from headlab.errors import MemoryBudgetError
        from headlab.interpret.report.sections.heads import memory_hint

        job = ctx.state["job"]
        return memory_hint(error, job.n) if isinstance(error, MemoryBudgetError) and job.mode == "full" else error

    def unit_inputs(self, ctx: Context, unit):
        return ctx.state["job"].inputs

    def run_unit(self, ctx: Context, unit, recording=None):
        """Every section's result from the runner's recording (full mode) or the job's own (streaming)."""
        from headlab.interpret.report.analyze_job import compute, record_once

        job, sections = ctx.state["job"], ctx.state["sections"]
        if recording is None:
            recording = record_once(job, sections)
        return compute(job, sections, recording)

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        """The result before the folder is written (:meth:`write` fills its figures from ``heads.json``)."""
        return InstrumentResult(
            self.result_kind, model=ctx.loaded.name, settings=ctx.settings, native=values[self.name]
        )

    def write(self, ctx: Context, result: InstrumentResult, path: Path) -> list[Path]:  # type: ignore[override]  # the runner passes this instrument's own result
        from headlab.interpret.report.folder import prepare_out_dir, write_report
        from headlab.results import Result

        s = ctx.state
        prepare_out_dir(path, force=ctx.options["force"])  # made now, with the work done (--force: old files go)
        before = {p: p.stat().st_mtime_ns for p in path.iterdir() if p.is_file()}
        report = write_report(s["job"], s["sections"], result.native, s["notes"])
        written = Result.load(report.json, what="the heads.json just written")
        result.settings, result.figures, result.native = written.settings, written.figures, report
        # every file of the report, the sections' own too (saliency.*, norms_layer_*.png, rollout.*)
        return sorted(p for p in path.iterdir() if p.is_file() and before.get(p) != p.stat().st_mtime_ns)


__all__ = ["Analyze"]
