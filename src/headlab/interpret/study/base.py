"""The contract every instrument implements, and the registry the CLI's rows and the runner read.

An instrument (head importance, probe, flow, ...) is one class: it declares its **options** (:class:`Option`:
the CLI name, type, default, help, choices and a check in the CLI's own words), the **inputs** it reads (an
option whose ``reads`` names a :mod:`headlab.reading` kind), where its **output** goes (:class:`Output`), and
the **capture sites** it needs; then it splits its work into keyed **units** (a configuration, a batch, a
text), computes each (:meth:`Instrument.run_unit`), and puts them together in one
:class:`headlab.results.Result` envelope (:meth:`Instrument.finish`). Everything around that (checking
before the model loads, reading, loading, recording once, progress, Ctrl-C, resume, torchrun, writing) is
the runner's (:mod:`headlab.interpret.study.runner`), so an instrument holds only its own idea.

The hooks are called in this order, each with the run's :class:`Context`::

    check(ctx)           options alone, before anything is read or loaded (each Option's own check ran first)
    prepare(ctx)         the inputs are read (ctx.data); a check of inputs against options, still before the load
    load(ctx)            the model (default: headlab.models.load(options["model"]))
    check_loaded(ctx)    options and inputs against the model, before the work
    units(ctx)           the work, as [Unit(key, payload), ...]
    sites(ctx)           capture sites the one recording of a unit must hold (none: no recording)
    run_unit(ctx, unit, recording) -> a value (JSON-able through unit_to_json, so an interrupted run keeps it)
    finish(ctx, values)  -> a Result (InstrumentResult keeps the library's own object beside it)
    write(ctx, result, path) -> files

Showing a result on the terminal is not an instrument's: the command line's views (:mod:`headlab.cli.views`, one
file per shipped instrument) draw it; an instrument of your own may define ``render(ctx, outcome, console, err)``,
which the views use when no view is registered for it, else the envelope's figures are printed.

:class:`Part` is what an instrument shares with a report section of ``headlab analyze``
(:class:`headlab.interpret.report.sections.base.Section` derives from it): a name, whether it is active,
and the sites and statistics it reads, declared before the one recording.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import headlab.checks as checks
from headlab.distributed.placement import TensorParallel
from headlab.errors import ConfigError
from headlab.reading import KINDS
from headlab.registry import Registry  # the one registry type, re-exported here
from headlab.results import Result

REQUIRED = ...  # an Option's default when the option must be given


class Part:
    """A named piece of analysis that declares, before the model runs, what the one recording must hold."""

    name: ClassVar[str]

    def active(self, ctx) -> bool:
        """Whether this part has anything to say for ``ctx`` (asked before the run)."""
        return True

    def sites(self, ctx) -> list[str]:
        """Capture sites (names or globs) the one recording must hold for this part."""
        return []

    def stats(self, ctx) -> set[str]:
        """Map-free statistics (:func:`headlab.attention_stats` names) read from the ``stats`` sites."""
        return set()


@dataclass(frozen=True)
class Option:
    """One option of an instrument, as the CLI shows it and the runner checks it.

    >>> top = Option("top", "--top", int, 10, "tokens shown per row", check=at_least(1))
    >>> top.validate(0, {})
    Traceback (most recent call last):
    ...
    headlab.errors.ConfigError: --top must be at least 1, got 0
    """

    name: str  # the Python name (a key of the options dict)
    flag: str | None  # the CLI name ("--top"); None for a positional argument
    type: type = str  # str, int, float, bool or Path
    default: Any = None  # REQUIRED (...) when it must be given
    help: str = ""
    choices: Sequence[str] = ()  # the allowed values (None always allowed): "unknown --x 'v'; choose one of ..."
    check: Callable[[Any, Option, dict], None] | None = None  # (value, option, options); raises in the CLI's words
    short: str | None = None  # "-m"
    aliases: tuple[str, ...] = ()  # more long names ("--kv-policy" for "--policy")
    off: str | None = None  # a bool's off switch ("--no-confidence"), shown as --confidence/--no-confidence
    metavar: str | None = None  # the name an argument is called by in messages ("TEXT")
    reads: str | None = None  # a headlab.reading kind: this option names an input the runner reads
    setting: bool = True  # part of the result's settings (False: where the output goes, how it is shown)
    # from Python only (in-memory inputs, library settings): the command line has no flag for it; the runner checks
    # it as any other (named by its Python name) when a library function hands it over
    python: bool = False
    python_name: str | None = None  # the library function's name for it, where not ``name`` ("n_draws" for --draws)

    def __post_init__(self) -> None:
        if self.reads is not None and self.reads not in KINDS:
            raise TypeError(f"option {self.name}: reads={self.reads!r} is not an input kind; use one of {KINDS}")

    @property
    def label(self) -> str:
        """How messages name the option: its flag, or an argument's metavar."""
        return self.flag or self.metavar or self.name.upper()

    def validate(self, value, options: dict) -> None:
        if value is None or value is REQUIRED:
            return
        if self.choices and value not in self.choices:
            raise ConfigError(f"unknown {self.label} {value!r}; choose one of {', '.join(self.choices)}")
        if self.check is not None:
            self.check(value, self, options)


def at_least(low, what: str = "") -> Callable[[Any, Option, dict], None]:
    """An :class:`Option` check: the value is finite and ``>= low`` (the CLI's ``check_at_least`` message)."""

    def check(value, option: Option, options: dict) -> None:
        checks.at_least(option.label, value, low, what=what)  # inf and NaN: "a finite number of at least ..."

    return check


@dataclass(frozen=True)
class Output:
    """Where an instrument's result goes: the option naming it, a folder or a file, and what may be replaced."""

    option: str = "out"  # the Option (by name) that holds the path; None given: nothing is written
    folder: bool = True  # a folder (the result file named by ``file`` goes in it) or the result file itself
    file: str | None = "{name}.json"  # the result file in the folder, formatted with the options and ``name``
    allow_existing: bool = False  # the folder may hold other files (commands that add theirs beside others)
    replace: bool = False  # an earlier result file of the same name is replaced without --force
    force: str | None = None  # the Option (by name) that allows writing into a non-empty folder / over a file


@dataclass(frozen=True)
class Unit:
    """One piece of the work: ``key`` names it in the result file (so a resumed run skips it); ``payload``
    is whatever the instrument needs to run it (a text, a batch, a configuration)."""

    key: str
    payload: Any = None


@dataclass
class Context:
    """One run of one instrument: its options, what was read and loaded, where it writes, how it reports."""

    instrument: Instrument
    options: dict
    data: dict = field(default_factory=dict)  # the inputs read by the runner, by option name
    loaded: Any = None  # the model (None before the load, or for instruments without one)
    path: Path | None = None  # the result file, or the output folder of an instrument without one
    progress: Callable[[str, int, int], None] = lambda stage, done, total: None
    rank: int = 0
    world: int = 1
    # the model is sharded by heads over the ranks (the request in its one form; None: not sharded); the runner sets it
    tensor_parallel: TensorParallel | None = None
    state: dict = field(default_factory=dict)  # the instrument's own, from one hook to the next
    # the values of the units finished so far, by key: a resumed run's from the file, then each unit's as it ends
    # (units that build on the one before, such as training steps, read the last one here)
    kept: dict = field(default_factory=dict)
    # run by a library function (:func:`~headlab.interpret.study.runner.call`), not by a command: options are
    # named by their Python names, every rank gets the result, and nothing is said on the terminal
    python: bool = False
    resume: bool = False  # the run goes on from the units its output kept (--resume), known from check() on

    @property
    def settings(self) -> dict:
        """The options that are settings (JSON-able: paths as strings)."""

        def plain(v):  # a path as its string, a model handed over from Python as its name (else its class's)
            if isinstance(v, Path):
                return str(v)
            if v is None or isinstance(v, str | int | float | bool | list | tuple | dict):
                return v
            return getattr(v, "name", None) or type(v).__name__

        return {o.name: plain(self.options.get(o.name)) for o in self.instrument.options if o.setting}

    @property
    def main(self) -> bool:
        return self.rank == 0


@dataclass(eq=False)
class InstrumentResult(Result):
    """A :class:`~headlab.results.Result` that also keeps the library's own result object (for rendering)."""

    native: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, native, payload: dict | None = None) -> InstrumentResult:
        """From a library result whose ``to_json()`` is already an envelope (or ``payload``, if given)."""
        r = Result.from_json(payload if payload is not None else native.to_json())
        return cls(r.kind, model=r.model, settings=r.settings, figures=r.figures, version=r.version, native=native)


@dataclass
class Outcome:
    """What the runner hands back: the result (None when interrupted before the end), the files written, and
    how many units were kept when interrupted."""

    result: Result | None
    path: Path | None = None
    files: list[Path] = field(default_factory=list)
    interrupted: bool = False
    kept: int = 0
    total: int = 0
    main: bool = True  # False on torchrun ranks other than 0 (they neither write nor render)
    ctx: Context | None = field(default=None, repr=False)  # the run's context (options, inputs, model, state)


#: ``--json`` of an instrument that declares none: its command prints the result envelope as JSON on stdout
ENVELOPE_JSON = Option("as_json", "--json", bool, False, "print the result as JSON", setting=False)


class Instrument(Part):
    """One analysis. Subclasses set ``name`` and ``options`` and implement :meth:`run_unit` and :meth:`finish`.

    Options without a ``--json`` of their own get :data:`ENVELOPE_JSON` (every command prints its result as JSON
    on request)."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        opts = cls.__dict__.get("options")
        if opts and not any(o.flag == "--json" for o in opts):
            cls.options = (*opts, ENVELOPE_JSON)

    kind: ClassVar[str | None] = None  # the result kind (default: ``name``)
    summary: ClassVar[str] = ""  # the CLI's help text
    # the command line's words for it ("" is the name; "heads importance" puts it under `headlab heads`; None: no
    # command): headlab.cli.table makes every registered instrument a command
    command: ClassVar[str | None] = ""
    options: ClassVar[tuple[Option, ...]] = ()
    output: ClassVar[Output | None] = None
    parallel: ClassVar[str] = "units"  # torchrun: "units" split across ranks; "inside": the library shards itself
    # each unit starts from where the one before left (training steps): under torchrun the units are not split,
    # the first data rank runs them all, as one process would, and the runner gathers them as any other
    chained: ClassVar[bool] = False
    resumable: ClassVar[bool] = False  # the CLI row gets --resume, and finished files keep their units
    keeps_units: ClassVar[bool] = True  # with resumable: False, a finished file is the result alone (its units are
    # in it already, or too large); --resume then finishes interrupted runs only
    announce: ClassVar[bool] = True  # the runner shows its own phases (loading, units) on the display
    display: ClassVar[bool] = True  # the runner opens the display (False: the library draws its own bars)
    needs_model: ClassVar[bool] = True
    # whether the instrument runs on a model sharded by tensor parallelism (the CLI row gets --tensor-parallel);
    # a string says why not, and the runner refuses --tensor-parallel with it before anything is read
    sharded: ClassVar[bool | str] = True
    stage: ClassVar[str] = "units"  # the progress stage of the units
    # the work reads text through the model's tokenizer: a model folder without tokenizer files is refused before
    # the load (the runner), instead of after it
    reads_text: ClassVar[bool] = False

    @property
    def result_kind(self) -> str:
        return self.kind or self.name

    def option(self, name: str) -> Option:
        for o in self.options:
            if o.name == name:
                return o
        raise KeyError(f"{self.name} has no option {name!r}")

    def defaults(self) -> dict:
        return {o.name: o.default for o in self.options}

    # ---- the hooks ------------------------------------------------------------------------------
    def check(self, ctx: Context) -> None:
        """Checks that need several options together (each option's own check has run)."""

    def prepare(self, ctx: Context) -> None:
        """After the inputs are read (``ctx.data``), before the load: inputs against options."""

    def load(self, ctx: Context):
        """The model; default ``headlab.models.load(options["model"])`` (looked up at call time), sharded by
        heads over the ranks when the run asks for tensor parallelism (``ctx.tensor_parallel``)."""
        import headlab.models

        if not isinstance(ctx.options["model"], str | Path):  # a model loaded already (from Python): used as is
            return ctx.options["model"]
        if ctx.tensor_parallel is not None:
            return headlab.models.load(ctx.options["model"], tensor_parallel=ctx.tensor_parallel)
        return headlab.models.load(ctx.options["model"])

    def check_loaded(self, ctx: Context) -> None:
        """Options and inputs against the loaded model, before the work."""

    def units(self, ctx: Context) -> list[Unit]:
        """The work, as keyed units; default one unit."""
        return [Unit(self.name)]

    def unit_inputs(self, ctx: Context, unit: Unit):
        """The model inputs of ``unit`` when :meth:`sites` asks for a recording (text, ids or a dict)."""
        return unit.payload

    def capture_options(self, ctx: Context) -> dict:
        """More keyword arguments for the runner's one recording (``backend=``, ``stats_kwargs=`` extras such as
        ``key_positions``); default none."""
        return {}

    def recording_refused(self, ctx: Context, error: Exception) -> Exception:
        """The error to raise when the recording is refused (a memory estimate, say), in the instrument's words
        (default: the error itself)."""
        return error

    def run_unit(self, ctx: Context, unit: Unit, recording=None):
        """One unit's value (``recording``: an ActivationCache of :meth:`sites` for this unit, or None)."""
        raise NotImplementedError

    def write_kept(self, ctx: Context, values: dict[str, Any], path: Path) -> list[Path]:
        """After Ctrl-C, for an instrument whose output is a folder of its own files (``output.file`` None): write
        what the finished units allow into ``path`` and return the files (default: nothing)."""
        return []

    def resumes(self, ctx: Context) -> bool:
        """Whether this run keeps units ``--resume`` can take (default :attr:`resumable`; an instrument some of whose
        runs keep none, such as one explanation beside the corpus study, says no for those)."""
        return self.resumable

    def unit_to_json(self, value):
        """A unit's value as JSON (what an interrupted file keeps); default: the value itself."""
        return value

    def unit_from_json(self, data):
        return data

    def finish(self, ctx: Context, values: dict[str, Any]) -> Result:
        """The result from every unit's value (by key, in the order of :meth:`units`)."""
        raise NotImplementedError

    def write(self, ctx: Context, result: Result, path: Path) -> list[Path]:
        """Write the result (``path``: the result file, or the folder when ``output.file`` is None)."""
        return [result.save(path)]


_INSTRUMENTS: Registry[Instrument] = Registry("an instrument", "it is the registry key and the result kind")


def register(cls: type[Instrument]) -> type[Instrument]:
    """Class decorator: add an instrument (the runner and the CLI's rows find it by ``name``)."""
    return _INSTRUMENTS.register(cls)


def registered() -> list[Instrument]:
    return _INSTRUMENTS.registered()


#: the modules that register the shipped instruments (a package: every module in it), imported by :func:`get` the
#: first time a name is not registered yet: the rooms' named functions run their instrument by name
HOMES = (
    "headlab.interpret.instruments",
    "headlab.interpret.report.instrument",
    "headlab.decode.instrument",
    "headlab.decode.gates_instrument",
    "headlab.decode.suite_instrument",
    "headlab.decode.disagree_instrument",
    "headlab.decode.quant_error_instrument",
)


def get(name: str) -> Instrument:
    """The instrument registered as ``name`` (a shipped one is imported from :data:`HOMES` on first use)."""
    if _INSTRUMENTS.find(name) is None:
        from importlib import import_module

        for home in HOMES:  # by name: the homes sit above the rooms whose functions call the runner
            import_module(home)
    return _INSTRUMENTS.get(name)


def unregister(name: str) -> None:
    _INSTRUMENTS.unregister(name)


__all__ = [
    "ENVELOPE_JSON",
    "Context",
    "Instrument",
    "InstrumentResult",
    "Option",
    "Outcome",
    "Output",
    "Part",
    "REQUIRED",
    "Registry",
    "Unit",
    "at_least",
    "get",
    "register",
    "registered",
    "unregister",
]
