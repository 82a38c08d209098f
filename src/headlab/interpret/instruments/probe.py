"""``probe``: which heads track which dependency relations of a treebank (Clark et al. 2019), as an instrument.

The units are the probing room's :class:`~headlab.interpret.probing.head_scores.ProbeRun`'s, decided after the
load from the trees and the model: each batch of sentences (its sums: hits per head, relation and direction, gold
counts, surface sums, the Jensen-Shannon sums of the head-map sentences it holds) and each batch of the gradient
test; the runner splits them over the ranks under torchrun, gathers them on rank 0, keeps them on Ctrl-C (in
``OUT/relations.json``) and resumes them with ``--resume``; :meth:`Probe.finish` adds them in order into the
:class:`~headlab.interpret.probing.probe_result.ProbeResult` ``headlab.probe`` returns. The runner reads
``--treebank`` as CoNLL-U before the model loads (a missing file, a folder, bytes that are not UTF-8 or a line
that is not CoNLL-U get one line); :meth:`Probe.prepare` then builds the trees from what was read and checks
``--relations`` against them, still before the load, so the file is read once. The result goes to ``--out`` as
relations.csv/.json, two PNGs and probe.html; the command's view is :mod:`headlab.cli.views.probe`.

:func:`headlab.probe` runs here too (the runner's :func:`~headlab.interpret.study.runner.call`), with the same
units: it hands over a treebank already read (``trees``) or the file, and its settings (``backend``,
``head_map_sentences``, ``grad_sentences``, ...), which the command line leaves at their defaults.
"""

from __future__ import annotations

from pathlib import Path

from headlab.errors import InputError
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

# headlab.probe's settings, handed to ProbeRun when given (None: ProbeRun's default, head_scores.HEAD_MAP_SENTENCES ...)
SETTINGS = ("head_map_sentences", "head_map_budget", "grad_sentences", "min_count", "batch_bytes")


def _loss_model(value, option: Option, options: dict) -> None:
    """A --loss-model other than auto / none names a known model or an existing folder (checked before the load);
    a model handed over from Python is taken as it is."""
    from headlab.models.named_models import ALIASES, KNOWN_MODELS

    if not isinstance(value, str):
        return
    key = value.strip().lower()
    if not key:  # '' reached the load and was refused there as "the model name is empty", after the main load
        raise InputError(f"{option.label} is empty; give 'auto', 'none', a known model name or a model folder")
    if key in ("auto", "none") or ALIASES.get(key, key) in KNOWN_MODELS:
        return
    path = Path(value).expanduser()
    if not path.is_dir():
        raise InputError(
            f"{option.label} {value!r}: {'is a file, not a model folder' if path.exists() else 'does not exist'}"
            "; give 'auto', 'none', a known model name or a model folder"
        )


def _none_or_more(value, option: Option, options: dict) -> None:
    """A count of sentences that may be 0 (the part is not run), in :class:`ProbeRun`'s words."""
    if value < 0:
        raise InputError(f"{option.label} must be 0 or more, got {value}")


@register
class Probe(Instrument):
    """Every head scored on every dependency relation of a treebank, against the best fixed-offset baseline."""

    name = "probe"
    reads_text = True  # a model folder without a tokenizer is refused before the load
    summary = """Score every head on every dependency relation of a treebank against the best fixed-offset baseline.

Example: headlab probe --treebank en_ewt-ud-dev.conllu --limit 200 --out probe-minilm

Data-parallel with torchrun: `torchrun --nproc-per-node 2 -m headlab probe --treebank FILE ...` splits
the batches of sentences across the processes and adds their sums; rank 0 shows the progress and writes the
output. Ctrl-C keeps the finished batches in OUT/relations.json; --resume finishes the rest."""
    options = (
        Option(
            "treebank",
            "--treebank",
            Path,
            REQUIRED,
            "a CoNLL-U file with gold trees (e.g. UD English-EWT dev)",
            short="-t",
            reads="conllu",
        ),
        Option("model", "--model", str, "minilm", "a known model name (minilm) or a local model folder", short="-m"),
        Option(
            "limit",
            "--limit",
            int,
            None,
            "read at most N sentences from the top of the file",
            short="-n",
            check=at_least(1, " sentence"),
        ),
        Option("relations", "--relations", str, None, "study only these, e.g. det,nsubj,obj", short="-r"),
        Option("fold_subtypes", "--fold-subtypes", bool, False, "count nmod:poss as nmod, obl:tmod as obl, ..."),
        Option(
            "out",
            "--out",
            Path,
            None,
            "write relations.csv/.json, two PNGs and probe.html here",
            short="-o",
            setting=False,
        ),
        Option("force", "--force", bool, False, "write into a non-empty --out folder", setting=False),
        Option(
            "loss_model",
            "--loss-model",
            str,
            "auto",
            "model whose loss the [SEP] gradient test uses ('auto', 'none' or a folder)",
            check=_loss_model,
        ),
        Option("as_json", "--json", bool, False, "print the best head per relation as JSON", setting=False),
        # headlab.probe's: a treebank already read, and the library's settings (the command keeps the defaults)
        Option(
            "trees", None, object, None, "a Treebank already read (in place of treebank)", python=True, setting=False
        ),
        Option("backend", None, str, "auto", "the backend of layers not captured", python=True),
        Option(
            "head_map_sentences",
            None,
            int,
            None,
            "sentences whose maps feed the head map",
            python=True,
            check=_none_or_more,
        ),
        Option("head_map_budget", None, int, None, "the head map's cost in elements", python=True),
        Option("grad_sentences", None, int, None, "sentences of the gradient test", python=True, check=_none_or_more),
        Option("min_count", None, int, None, "cases a relation needs before a head beats its baseline", python=True),
        Option("batch_bytes", None, int, None, "the captured maps of one batch stay below this", python=True),
    )
    # relations.json is the result file: an interrupted run keeps its units there, and --resume reads them back
    output = Output("out", folder=True, file="relations.json", force="force")
    resumable = True
    stage = "batches"

    def check(self, ctx: Context) -> None:
        """A treebank, as a file or (from Python) already read."""
        if ctx.options["treebank"] is None and ctx.options["trees"] is None:
            tb = self.option("treebank")
            raise InputError(f"{'treebank' if ctx.python else tb.label} is required: {tb.help}, or trees already read")

    def prepare(self, ctx: Context) -> None:
        """The trees, built from the file the runner read (``ctx.data["treebank"]``, read once: nothing else
        reads it again) or handed over already read (``trees``: its limit and folding were applied then), and
        the relations asked for, before the load (a relation absent from the file stops here)."""
        from headlab.interpret.probing.head_scores import choose_relations
        from headlab.interpret.probing.treebank import read_treebank

        o = ctx.options
        tb = o["trees"]
        if tb is None:
            tb = read_treebank(ctx.data["treebank"], fold_subtypes=o["fold_subtypes"], limit=o["limit"])
        choose_relations(tb, o["relations"])
        ctx.state["treebank"] = tb

    def units(self, ctx: Context) -> list[Unit]:
        """The batches of sentences, then the gradient test's (:class:`ProbeRun`, planned from the trees and the
        loaded model; the loss model of the gradient test is resolved here)."""
        from headlab.interpret.probing.head_scores import ProbeRun

        o = ctx.options
        loss = o["loss_model"]
        run = ProbeRun(
            ctx.loaded,
            ctx.state["treebank"],
            limit=o["limit"],
            backend=o["backend"],
            relations=o["relations"],
            fold_subtypes=o["fold_subtypes"],
            loss_model=None if isinstance(loss, str) and loss.lower() == "none" else loss,
            **{name: o[name] for name in SETTINGS if o[name] is not None},
        )
        ctx.state["run"] = run
        return [Unit(key) for key in run.units()]

    def run_unit(self, ctx: Context, unit, recording=None):
        run = ctx.state["run"]
        run.check(ctx.kept)  # units kept by --resume for another treebank or model: refused before any work
        return run.unit(unit.key)  # the batch's sums, as JSON-able lists

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        return InstrumentResult.of(ctx.state["run"].finish(values))

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        """relations.csv/.json, the PNGs and probe.html beside ``path`` (relations.json, the result file: the
        finished file is :meth:`ProbeResult.to_json`, without the units)."""
        from headlab.interpret.probing.render import write_outputs

        return write_outputs(result.native, path.parent)


__all__ = ["Probe"]
