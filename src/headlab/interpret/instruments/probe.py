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
relations.csv/.json, two PNGs and probe.html.
"""

from __future__ import annotations

from pathlib import Path

from headlab.errors import InputError
from headlab.interpret.instruments.base import (
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
from headlab.results import print_json


def _loss_model(value: str, option: Option, options: dict) -> None:
    """A --loss-model other than auto / none names a known model or an existing folder (checked before the load)."""
    from headlab.models.named_models import ALIASES, KNOWN_MODELS

    key = value.strip().lower()
    if not key:  # '' reached the load and was refused there as "the model name is empty", after the main load
        raise InputError("--loss-model is empty; give 'auto', 'none', a known model name or a model folder")
    if key in ("auto", "none") or ALIASES.get(key, key) in KNOWN_MODELS:
        return
    path = Path(value).expanduser()
    if not path.is_dir():
        raise InputError(
            f"--loss-model {value!r}: {'is a file, not a model folder' if path.exists() else 'does not exist'}"
            "; give 'auto', 'none', a known model name or a model folder"
        )


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
    )
    # relations.json is the result file: an interrupted run keeps its units there, and --resume reads them back
    output = Output("out", folder=True, file="relations.json", force="force")
    resumable = True
    stage = "batches"

    def prepare(self, ctx: Context) -> None:
        """The trees, built from the file the runner read (``ctx.data["treebank"]``, read once: neither this
        nor :func:`probe` reads it again), and the relations asked for, before the load (a relation absent
        from the file stops here)."""
        from headlab.interpret.probing.head_scores import choose_relations
        from headlab.interpret.probing.treebank import read_treebank

        o = ctx.options
        tb = read_treebank(ctx.data["treebank"], fold_subtypes=o["fold_subtypes"], limit=o["limit"])
        choose_relations(tb, o["relations"])
        ctx.state["treebank"] = tb

    def units(self, ctx: Context) -> list[Unit]:
        """The batches of sentences, then the gradient test's (:class:`ProbeRun`, planned from the trees and the
        loaded model; the loss model of the gradient test is resolved here)."""
        from headlab.interpret.probing.head_scores import ProbeRun

        o = ctx.options
        run = ProbeRun(
            ctx.loaded,
            ctx.state["treebank"],
            limit=o["limit"],
            relations=o["relations"],
            fold_subtypes=o["fold_subtypes"],
            loss_model=None if o["loss_model"].lower() == "none" else o["loss_model"],
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

    def render(self, ctx: Context, outcome, console, err) -> None:
        r = outcome.result.native
        if ctx.options["as_json"]:
            print_json(r.summary())
            return
        console.print(
            f"{r.model} ({r.family}{', causal' if r.causal else ''}): {r.sentences} sentences, {r.tokens} "
            f"tokens, {len(r.skipped)} skipped, {r.seconds:.1f} s",
            highlight=False,
            soft_wrap=True,
        )
        console.print(
            f"{'relation':<14} {'direction':<10} {'head':>6} {'acc %':>6} {'offset':>6} {'base %':>6} {'count':>6}",
            highlight=False,
        )
        for b in r.best_heads:
            if b.count < r.min_count:
                continue
            mark = "*" if b.margin > 0 else " "
            console.print(
                f"{b.relation:<14} {b.direction:<10} {f'{b.layer}-{b.head}':>6} {100 * b.accuracy:6.1f} "
                f"{b.baseline_offset:+6d} {100 * b.baseline_accuracy:6.1f} {b.count:6d} {mark}",
                highlight=False,
            )
        for note in r.notes:
            console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
        if outcome.files:
            console.print(
                f"[bold]wrote:[/] {', '.join(str(f) for f in outcome.files)}", highlight=False, soft_wrap=True
            )


__all__ = ["Probe"]
