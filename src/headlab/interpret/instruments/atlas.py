"""``atlas``: every head's roles (the kinds of :data:`~headlab.interpret.atlas.kinds.KINDS`), checked causally.

The computation is the atlas room's (:class:`~headlab.interpret.atlas.run.AtlasRun`); this file declares the
options of ``headlab atlas`` and checks them (:mod:`headlab.cli.views.atlas` shows the result). :func:`headlab.atlas`
runs the same instrument (:func:`headlab.interpret.study.runner.call`): its in-memory texts (``texts_in_memory``)
and its library settings (``n_repeated``, ``window``, ``n_boot``, ``max_rows``, ``treebank_limit``, ``copying``,
``evidence``, ``thresholds``) are Python-only options, messages from Python name ``--top-k``, ``--draws``,
``--needles`` and ``--haystack`` as its arguments (``k``, ``n_draws``, ``needle_trials``, ``haystack_tokens``),
and its ``resume=PATH`` is the runner's checkpoint (``out`` and ``file`` name ``PATH``; ``checkpoint``: the file
keeps the units alone and goes once the atlas is complete; a file of another run's units is replaced, where the
command refuses it). The checks come in three steps, each as early as what it needs allows:

1. options alone (:meth:`HeadAtlas.check` and each :class:`Option`'s check): the kinds asked for, the counts;
2. before the load (:meth:`HeadAtlas.prepare`): ``--texts`` and ``--treebank`` read, and the sizes against the
   model's positions as its config files tell them (:mod:`.atlas_sizes`, no weights read);
3. once the model is loaded (:meth:`HeadAtlas.check_loaded`): what only the weights tell (its positions when the
   config did not say, a tokenizer or none, its vocabulary, its heads, the needle trial's own tokens).

From Python, the sizes against the model (2 and 3) are :class:`~headlab.interpret.atlas.run.AtlasRun`'s checks,
in ``atlas()``'s words, as they were before the atlas ran through the runner.

**The units are the atlas's phases** (repeated tokens, OV copying, natural text, each kind with its own input, each
task's causal checks, the evidence maps). A unit reads the values of the units before it (``ctx.kept``: a check
gates the top heads of the scores), and every value is JSON, so the runner keeps the finished phases on Ctrl-C
(``--out/atlas.json`` says ``"interrupted"``) and ``--resume`` runs only the rest, to the numbers of a run in one
go (every random choice is seeded from ``--seed`` where it is made).

**Why every rank runs every unit** (``parallel = "inside"``): a check, and the evidence maps, gate or draw the top
heads of the score phases before it, which under the runner's split would have run on other ranks and reach them
only once every unit has ended; and the work worth sharing is inside a phase (a check's configurations, the needle
trials), finer and more even than the few phases of unequal cost. So under torchrun each unit splits its own work
over the ranks (:mod:`headlab.interpret.atlas.run`); on a model sharded by tensor parallelism each score phase is a
collective of its group.
"""

from __future__ import annotations

import os
from pathlib import Path

from headlab.checks import int_at_least
from headlab.errors import ConfigError, InputError
from headlab.interpret.atlas.kinds import KINDS
from headlab.interpret.atlas.result import Thresholds
from headlab.interpret.instruments.atlas_sizes import check_loaded, check_positions, kinds_reading
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
from headlab.models.peek import peek_max_positions

MAX_DRAWS = 1000  # --draws: random head sets gated per check


def parse_kinds(spec: str | None) -> list[str] | None:
    """``--kinds "induction, sink"`` -> ``["induction", "sink"]`` (None: every kind the model allows); an
    unknown kind or an empty list is refused, naming the kinds there are."""
    if spec is None:
        return None
    asked = [k.strip() for k in spec.split(",") if k.strip()]
    bad = [k for k in asked if k not in KINDS]
    if bad or not asked:
        raise ConfigError(
            f"--kinds: unknown {', '.join(map(repr, bad)) or 'empty list'}; choose from {', '.join(KINDS)}"
        )
    return asked


def _draws(value, option: Option, options: dict) -> None:
    at_least(1)(value, option, options)
    if value > MAX_DRAWS:  # 10**12 loaded the model, then gated random head sets without end
        raise ConfigError(
            f"{option.label} must be at most {MAX_DRAWS:,} (random draws per check, a forward each; "
            f"10 is the default), got {value:,}"
        )


def _integer(low: int):
    """An :class:`Option` check of a library setting (a Python-only option): an integer of at least ``low``,
    in ``atlas()``'s words."""

    def check(value, option: Option, options: dict) -> None:
        int_at_least(option.label, value, low, message="{name} must be an integer of at least {low}, got {value!r}")

    return check


def _check_kinds(value, option: Option, options: dict) -> None:
    if not isinstance(value, str):  # a list from Python (atlas(kinds=[...])): its unknown kinds, in atlas()'s words
        from headlab.interpret.atlas.run import asked_kinds

        asked_kinds(value)
        return  # what the model cannot serve is refused after the load, with the kind's own reason
    kinds = parse_kinds(value)
    assert kinds is not None  # a given --kinds (validate skips None)
    on_treebank = [k for k in kinds if k in kinds_reading("treebank")]
    if on_treebank and options.get("treebank") is None:
        raise ConfigError(
            f"--kinds {on_treebank[0]} needs --treebank FILE.conllu (the dependency trees it is checked on)"
        )


def _check_treebank(path: str | os.PathLike, label: str = "--treebank") -> None:
    """The treebank read now (it is small next to a model), so a bad file stops the command before the load.
    Read by the probing room's reader (over :mod:`headlab.reading`), whose messages name the file's line."""
    from headlab.errors import TreebankError
    from headlab.interpret.probing.treebank import read_treebank

    p = Path(path).expanduser()
    if p.is_dir():
        raise InputError(f"{label} {str(p)!r} is a folder; give a CoNLL-U file (.conllu)")
    if not p.is_file():
        why = "is not a regular file" if p.exists() else "does not exist"
        raise InputError(f"{label} {str(p)!r} {why}; give a CoNLL-U file (.conllu)")
    try:
        read_treebank(p, limit=200)
    except TreebankError as e:
        raise InputError(f"{label}: {e}") from None


def _replace_foreign(ctx: Context, run) -> bool:
    """``atlas(resume=PATH)``: a file that keeps another run's units (other settings or inputs, or no checkpoint at
    all) is removed, so that the runner starts afresh, and the atlas says so (the command refuses such a file)."""
    from headlab.errors import HeadlabError
    from headlab.interpret.study.checkpoint import earlier_units, partial_path

    source = partial_path(ctx)
    if not source.is_file():
        return False
    try:
        if not run.foreign(earlier_units(ctx, run.units())):
            return False
    except HeadlabError:  # not a checkpoint of this instrument, or one of other settings
        pass
    source.unlink(missing_ok=True)  # under torchrun every rank reads it here: whichever rank comes first removes it
    return True


def _ids_if_needed(loaded, texts: list[str]) -> list:
    """A model without a tokenizer reads the file as lines of space-separated token ids."""
    if getattr(loaded, "tokenizer", None) is not None:
        return texts
    from headlab.interpret.heads.examples import token_ids_if_needed

    try:
        return token_ids_if_needed(loaded, [ln for ln in texts[0].splitlines() if ln.strip()])
    except InputError as e:
        raise InputError(f"--texts: {e}") from None


@register
class HeadAtlas(Instrument):
    """Every head scored on every kind of the literature, the top heads of each gated against random ones."""

    name = "atlas"
    kind = "head_atlas"
    summary = """Score every head on every head type of the literature and gate the top heads of each against random ones.

Example: headlab atlas --model smollm2 --out atlas-smollm2

Interrupted (Ctrl-C), the finished phases stay in DIR/atlas.json; the same command with --resume runs only
the rest. Data-parallel with torchrun: `torchrun --nproc-per-node 2 -m headlab atlas ...` splits the needle
trials and the checks' configurations across the processes; rank 0 shows the progress and writes the output."""
    options = (
        Option("model", "--model", str, "minilm", "a known model name (minilm, smollm2) or a model folder", short="-m"),
        Option(
            "kinds",
            "--kinds",
            str,
            None,
            f"comma-separated kinds (default: all the model allows): {', '.join(KINDS)}",
            short="-k",
            check=_check_kinds,
        ),
        # read whole by prepare (not reads="texts", one text per line): the atlas cuts its pieces from the file's
        # text as it is, and a model without a tokenizer reads its lines as token ids
        Option(
            "texts",
            "--texts",
            Path,
            None,
            "natural text for sink/local/needle (default: a shipped "
            "public-domain passage); token-id lines for a model without a tokenizer",
        ),
        Option("treebank", "--treebank", Path, None, "a CoNLL-U file: adds the syntactic kind", short="-t"),
        Option("out", "--out", Path, REQUIRED, "folder for atlas.json and atlas.html", short="-o", setting=False),
        Option("force", "--force", bool, False, "write into a non-empty --out folder", setting=False),
        Option("checks", "--checks", bool, True, "run the causal checks (gating heads)", off="--no-checks"),
        Option(
            "top_k",
            "--top-k",
            int,
            None,
            "heads gated per check (default 5% of the heads, 1 to 10)",
            check=at_least(1),
            python_name="k",
        ),
        Option("draws", "--draws", int, 10, "random draws per check", check=_draws, python_name="n_draws"),
        Option("half", "--half", int, 50, "length of the repeated half of the random sequences", check=at_least(2)),
        Option("n_texts", "--n-texts", int, 4, "natural-text pieces", check=at_least(1)),
        Option("max_tokens", "--max-tokens", int, 128, "tokens per natural-text piece", check=at_least(8)),
        Option(
            "needles",
            "--needles",
            int,
            4,
            "needle-in-a-haystack trials",
            check=at_least(1),
            python_name="needle_trials",
        ),
        Option(
            "haystack",
            "--haystack",
            int,
            256,
            "haystack tokens per needle trial",
            check=at_least(8),
            python_name="haystack_tokens",
        ),
        Option("seed", "--seed", int, 0, check=at_least(0)),
        Option("as_json", "--json", bool, False, "print the summary as JSON", setting=False),
        # from Python only (headlab.atlas): its in-memory texts, its settings the command leaves at their defaults,
        # and its checkpoint (resume=PATH: out is the folder, file the name, checkpoint says it keeps units alone)
        Option("texts_in_memory", None, object, None, "strings, or token-id sequences", python=True, setting=False),
        Option("treebank_limit", None, int, 200, "treebank sentences probed", python=True),
        Option("copying", None, bool, True, "the OV copying score", python=True),
        Option("n_repeated", None, int, 8, "repeated random sequences", python=True, check=_integer(2)),
        Option("window", None, int, 16, "keys counted as local", python=True, check=_integer(2)),
        Option("n_boot", None, int, 1000, "bootstrap resamples", python=True, check=_integer(2)),
        Option("max_rows", None, int, 32, "rows per forward", python=True, check=_integer(1)),
        Option("thresholds", None, object, Thresholds(), "the score of each role", python=True, setting=False),
        Option("evidence", None, bool, True, "the attention maps of each kind's top heads", python=True),
        Option("file", None, str, "atlas.json", "the result file in out", python=True, setting=False),
        Option("checkpoint", None, bool, False, "the file keeps the units alone", python=True, setting=False),
    )
    output = Output("out", folder=True, file="{file}", force="force")
    resumable = True  # Ctrl-C keeps the finished phases in atlas.json; --resume runs the rest
    # every rank runs every phase, and a phase splits its needle trials and check configurations over the ranks:
    # the checks read every earlier phase's scores on every rank (see the module's docstring)
    parallel = "inside"
    stage = "atlas phases"  # the runner's count of the phases, beside each phase's own progress

    def check(self, ctx: Context) -> None:
        kinds = ctx.options["kinds"]
        ctx.state["kinds"] = parse_kinds(kinds) if isinstance(kinds, str) else None if kinds is None else list(kinds)
        if ctx.options["texts"] is not None and ctx.options["texts_in_memory"] is not None:
            raise ConfigError("give texts (a file) or texts_in_memory (strings or token-id sequences), not both")

    def prepare(self, ctx: Context) -> None:
        from headlab.reading import read_file

        o = ctx.options
        ctx.data["texts"] = (
            None
            if o["texts"] is None
            else [read_file(o["texts"], "--texts", "texts", what="a plain-text file (UTF-8)")]
        )
        if isinstance(o["treebank"], str | os.PathLike):
            _check_treebank(o["treebank"], "treebank" if ctx.python else "--treebank")
        if not ctx.python:  # in the command's names; atlas() checks its sizes against the model as it always has
            limit = peek_max_positions(o["model"])  # from the config files alone: no weights read
            check_positions(o["model"], limit, ctx.state["kinds"], half=o["half"], max_tokens=o["max_tokens"])

    def check_loaded(self, ctx: Context) -> None:
        o, raw = ctx.options, ctx.data["texts"]
        texts = o["texts_in_memory"]
        if texts is None and raw is not None:
            texts = _ids_if_needed(ctx.loaded, raw)
        ctx.state["texts"] = texts
        if not ctx.python:  # the command's checks, in its names (from Python: AtlasRun's, in atlas()'s)
            check_loaded(
                ctx.loaded,
                o["model"],
                ctx.state["kinds"],
                texts=texts,
                checks=o["checks"],
                half=o["half"],
                max_tokens=o["max_tokens"],
                n_texts=o["n_texts"],
                haystack=o["haystack"],
                needles=o["needles"],
                top_k=o["top_k"],
                seed=o["seed"],
            )
        from headlab.interpret.atlas.run import AtlasRun  # looked up at call time

        ctx.state["atlas"] = run = AtlasRun(
            ctx.loaded,
            kinds=ctx.state["kinds"],
            texts=texts,
            treebank=o["treebank"],
            treebank_limit=o["treebank_limit"],
            checks=o["checks"],
            copying=o["copying"],
            k=o["top_k"],
            n_draws=o["draws"],
            half=o["half"],
            n_repeated=o["n_repeated"],
            window=o["window"],
            max_tokens=o["max_tokens"],
            n_texts=o["n_texts"],
            needle_trials=o["needles"],
            haystack_tokens=o["haystack"],
            n_boot=o["n_boot"],
            seed=o["seed"],
            max_rows=o["max_rows"],
            thresholds=o["thresholds"],
            evidence=o["evidence"],
            say=ctx.progress,
        )
        ctx.state["ran"] = []  # the phases this run computes (the others are resumed)
        ctx.state["replaced"] = o["checkpoint"] and ctx.path is not None and _replace_foreign(ctx, run)

    def units(self, ctx: Context) -> list[Unit]:
        return [Unit(key) for key in ctx.state["atlas"].units()]

    def _same_inputs(self, ctx: Context, values: dict) -> None:
        """Phases kept by an earlier run on other inputs (the --texts or --treebank file, or the model's weights,
        changed; the runner has compared the options) are refused."""
        foreign = ctx.state["atlas"].foreign(values)
        if foreign:
            raise InputError(
                f"--resume: {ctx.path} keeps phases ({', '.join(foreign)}) computed from other inputs "
                "(a changed --texts or --treebank file, or other weights); drop --resume to start again"
            )

    def run_unit(self, ctx: Context, unit: Unit, recording=None):
        if not ctx.state["ran"]:
            self._same_inputs(ctx, ctx.kept)
        ctx.state["ran"].append(unit.key)
        return ctx.state["atlas"].unit(unit.key, ctx.kept)  # JSON already: the file keeps it as it is

    def finish(self, ctx: Context, values: dict) -> InstrumentResult:
        from headlab.interpret.study.checkpoint import partial_path

        run = ctx.state["atlas"]
        self._same_inputs(ctx, values)
        resumed = [k for k in run.units() if k not in ctx.state["ran"]]
        source = None if ctx.path is None else partial_path(ctx)  # where the runner kept them
        a = run.finish(values, resumed=resumed, source=source)
        if ctx.state["replaced"]:
            a.notes.append(f"{source} held another run's units (other settings or inputs); they were replaced")
        return InstrumentResult.of(a)

    def write(self, ctx: Context, result, path: Path) -> list[Path]:
        from headlab.interpret.atlas.page import render_page
        from headlab.interpret.study.checkpoint import partial_path
        from headlab.results import write_json

        if ctx.options["checkpoint"]:  # atlas(resume=PATH): the checkpoint goes once the atlas is complete
            partial_path(ctx).unlink(missing_ok=True)
            return []

        a = result.native
        page = path.parent / "atlas.html"
        files = [write_json(path, a.to_json())]
        page.write_text(render_page(a), encoding="utf-8")
        return [*files, page]


__all__ = ["HeadAtlas", "check_loaded", "check_positions", "parse_kinds"]
