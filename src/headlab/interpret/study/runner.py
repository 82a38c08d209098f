"""The study runner: the one lifecycle every instrument goes through.

:func:`run` (one instrument) and :func:`run_together` (several on the same model and units, recorded once):

1. **check**: every option (its choices and its own check, in the CLI's names), the instrument's checks of
   options together, and the output path (:func:`headlab.outputs.check_output_dir` / ``check_output_file``),
   all before anything is read or loaded;
2. **read**: every option that names an input goes through :func:`headlab.reading.read`, then
   :meth:`~headlab.interpret.study.base.Instrument.prepare` checks the inputs against the options;
3. **load** the model (under torchrun the process group is joined first), then ``check_loaded``;
4. **units**: with ``resume``, the units already in the output file are skipped; under torchrun
   (``WORLD_SIZE > 1``) the rest are split across ranks (every W-th, from the rank) and gathered on rank 0,
   unless the instrument shards inside its library function (``parallel = "inside"``). A unit that needs a
   recording gets one :func:`~headlab.interpret.capture.capture` of the union of the sites of every instrument
   run together. Progress goes through the protocol (``progress(stage, done, total)``, rank 0 only);
5. **Ctrl-C** (KeyboardInterrupt) stops the units; every finished unit is kept: the file written says
   ``"interrupted": {"kept": k, "of": n}`` with the units' values under ``"units"``, the runner prints one line
   saying so, and a run with ``resume=True`` finishes only the rest;
6. **finish** and **write** the result envelope (rank 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from headlab.distributed.placement import Placement, TensorParallel
from headlab.errors import HeadlabError, InputError
from headlab.interpret.study.base import REQUIRED, Context, Instrument, Outcome, Unit
from headlab.interpret.study.checkpoint import (
    INTERRUPTED_KEY,
    UNITS_KEY,
    UNITS_SETTINGS_KEY,
    earlier_units,
    partial_path,
    partial_result,
    resume_line,
    writes_folder,
)
from headlab.locks import output_lock
from headlab.outputs import check_output_dir, check_output_file
from headlab.progress import reporter
from headlab.reading import read
from headlab.results import to_json_value


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def check_options(instrument: Instrument, options: dict, *, python: bool = False) -> dict:
    """The options completed with their defaults and checked one by one, then together (nothing read or loaded).

    ``python``: the options come from a library function, so messages name them as Python does (``batch_size``,
    not ``--batch-size``); from the command line, the Python-only options (``Option.python``) are not taken."""
    given = dict(options)
    known = {o.name for o in instrument.options if python or not o.python}
    unknown = set(given) - known
    if unknown:
        raise InputError(
            f"{instrument.name} takes no option {', '.join(sorted(unknown))}; its options are "
            f"{', '.join(o.name for o in instrument.options if o.name in known)}"
        )
    full = {**instrument.defaults(), **given}
    for o in instrument.options:
        named = dataclasses.replace(o, flag=None, metavar=o.python_name or o.name) if python else o
        if full[o.name] is REQUIRED:
            raise InputError(f"{named.label} is required: {o.help}")
        named.validate(full[o.name], full)
    return full


def output_path(ctx: Context, *, resume: bool = False) -> Path | None:
    """Check where the result goes (before any work) and return the result file (or the folder)."""
    spec = ctx.instrument.output
    if spec is None or ctx.options.get(spec.option) is None:
        return None
    value = Path(ctx.options[spec.option]).expanduser()
    flag = ctx.instrument.option(spec.option).label
    force = bool(spec.force and ctx.options.get(spec.force))
    if not spec.folder:
        return check_output_file(value, flag, force=force or spec.replace or resume)
    folder = check_output_dir(value, flag, force=force, allow_existing=spec.allow_existing or resume)
    if spec.file is None:
        return folder
    name = spec.file.format(name=ctx.instrument.name, **ctx.options)
    path = folder / name
    if path.is_dir():
        raise InputError(
            f"{flag} {str(value)!r}: {name} in it is a folder, where the result would go; move it "
            "away or choose another folder"
        )
    if folder.is_dir():
        check_output_file(path, flag, force=force or spec.replace or resume)
    return path


def _read_inputs(ctx: Context) -> None:
    for o in ctx.instrument.options:
        value = ctx.options.get(o.name)
        if o.reads is not None and value is not None:
            ctx.data[o.name] = read(o.reads, value, o.name if ctx.python else o.label)  # as the caller named it


def run(
    instrument: Instrument | str,
    options: dict | None = None,
    *,
    resume: bool = False,
    progress=None,
    transient: bool = False,
    say: Callable[[str], None] = _stderr,
    tensor_parallel: bool | int | TensorParallel | None = False,
    command: str | None = None,
) -> Outcome:
    """Run one instrument through the whole lifecycle (see the module docstring); returns its :class:`Outcome`.

    ``instrument``: an instance or a registered name; ``options``: by Python name (defaults filled in);
    ``progress``: True (a display on stderr), False/None or ``progress(stage, done, total)``; ``say``: where
    the runner's own lines go (the interrupted line); ``tensor_parallel``: under torchrun, shard the model by
    heads over every rank (True) or over groups of N ranks (N: a (data, tensor) mesh, the units split across
    the groups), as :func:`headlab.load` does; ``command``: the command line that started the run (the CLI's
    rows pass it), so the line said on Ctrl-C is the command that resumes it."""
    return run_together(
        [(instrument, options or {})],
        resume=resume,
        progress=progress,
        transient=transient,
        say=say,
        tensor_parallel=tensor_parallel,
        command=command,
    )[0]


def check_tensor_parallel(instruments: Sequence[Instrument], tensor_parallel) -> TensorParallel | None:
    """``--tensor-parallel`` checked before anything is read (the request in its one form,
    :class:`~headlab.distributed.placement.TensorParallel`, returned): an instrument that cannot run sharded says
    why, and one process (no torchrun) is refused with the launch line."""
    request = TensorParallel.request(tensor_parallel)
    if request is None:
        return None
    for inst in instruments:
        if inst.sharded is not True:
            why = f": {inst.sharded}" if isinstance(inst.sharded, str) else ""
            raise InputError(
                f"--tensor-parallel: {inst.name} does not run on a model sharded by heads{why}; drop --tensor-parallel"
            )
        if not inst.needs_model:
            raise InputError(f"--tensor-parallel: {inst.name} loads no model; drop --tensor-parallel")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        raise InputError(
            "--tensor-parallel shards the model over several processes: launch with torchrun, e.g. "
            "`torchrun --nproc_per_node 2 -m headlab ... --tensor-parallel`"
        )
    request.group_size(world, flag=True)
    return request


def run_together(
    runs: Sequence[tuple[Instrument | str, dict]],
    *,
    resume: bool = False,
    progress=None,
    transient: bool = False,
    say: Callable[[str], None] = _stderr,
    tensor_parallel: bool | int | TensorParallel | None = False,
    command: str | None = None,
    python: bool = False,
) -> list[Outcome]:
    """Run several instruments on one model: one load, and per unit key one recording of the union of their
    sites (units of the same key must share their inputs). Each writes its own result. An output another run is
    writing is refused (:func:`headlab.results.output_lock`, a lock file beside it, held until the run ends).
    ``python``: run by a library function (see :func:`call`)."""
    from headlab.interpret.study.base import get

    ctxs = []
    for inst, opts in runs:  # 1. options and output paths, before anything else
        inst = get(inst) if isinstance(inst, str) else inst
        ctx = Context(inst, check_options(inst, opts, python=python), python=python, resume=resume)
        check_model_name(ctx)
        inst.check(ctx)
        ctxs.append(ctx)
    request = check_tensor_parallel([c.instrument for c in ctxs], tensor_parallel)
    for ctx in ctxs:
        ctx.tensor_parallel = request
    for ctx in ctxs:
        if resume and not ctx.instrument.resumes(ctx):  # before the output check lets --resume write into a folder
            raise InputError(f"--resume: {ctx.instrument.name} keeps no units with these options; drop --resume")
        ctx.path = output_path(ctx, resume=resume)
        if resume and (ctx.path is None or ctx.instrument.output is None):
            what = (
                f"give {ctx.instrument.option(ctx.instrument.output.option).label}"
                if ctx.instrument.output is not None and ctx.path is None
                else "drop --resume"
            )
            raise InputError(
                f"--resume keeps the units of {ctx.instrument.name}'s result file, and this run writes none; {what}"
            )
    with contextlib.ExitStack() as held:
        # torchrun's ranks share the output: rank 0 holds it (by RANK, or by a process group the caller started)
        if os.environ.get("RANK", "0") == "0" and Placement.here().rank == 0:
            for ctx in ctxs:
                if ctx.path is not None and ctx.instrument.output is not None:  # a path comes from the output
                    held.enter_context(
                        output_lock(_guarded(ctx), ctx.instrument.option(ctx.instrument.output.option).label)
                    )
        return _load_and_work(ctxs, resume=resume, progress=progress, transient=transient, say=say, command=command)


def check_model_name(ctx: Context) -> None:
    """An empty ``--model`` is refused with the other checks, before anything is read, made or loaded."""
    model = ctx.options.get("model")
    if ctx.instrument.needs_model and isinstance(model, str) and not model.strip():
        from headlab.errors import ModelError
        from headlab.models.named_models import known_names

        raise ModelError(f"the model name is empty; give a known name ({', '.join(known_names())}) or a model folder")


def check_tokenizer(ctx: Context) -> None:
    """An instrument that reads text, given a model folder without tokenizer files: refused before the load."""
    model = ctx.options.get("model")
    if not ctx.instrument.reads_text or not isinstance(model, str | Path):
        return
    from headlab.models.peek import TOKENIZER_FILES, peek_has_tokenizer

    if peek_has_tokenizer(str(model)) is False:
        raise InputError(
            f"--model {str(model)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}), and "
            f"{ctx.instrument.name} reads text; save the tokenizer beside the weights "
            "(tokenizer.save_pretrained(folder)) or choose another model"
        )


def _guarded(ctx: Context) -> Path:
    """The path a run's lock guards: the output folder (a folder output), else the result file."""
    spec = ctx.instrument.output
    assert spec is not None and ctx.path is not None  # called for a run that writes
    folder = Path(ctx.options[spec.option]).expanduser()
    return folder if spec.folder else ctx.path


def _load_and_work(ctxs: list[Context], *, resume: bool, progress, transient: bool, say, command) -> list[Outcome]:
    for ctx in ctxs:  # 2. inputs
        _read_inputs(ctx)
        ctx.instrument.prepare(ctx)
        check_tokenizer(ctx)
    from headlab.distributed.data import init_from_env

    rank, world = init_from_env()
    lead = ctxs[0]
    shown = rank == 0 and all(c.instrument.display for c in ctxs)  # one display: the runner's or the library's
    with reporter(progress if shown else False, transient=transient) as show:
        for ctx in ctxs:
            ctx.rank, ctx.world, ctx.progress = rank, world, show
        announce = any(c.instrument.announce for c in ctxs)
        loaded = None
        if any(c.instrument.needs_model for c in ctxs):  # 3. the model, once
            if announce and isinstance(lead.options.get("model"), str | Path):  # a model by name (not handed over)
                # quiet: a refusal by the load or by check_loaded stays the one line on stderr
                loading = f"loading model {lead.options.get('model', '')}".rstrip()
                show.quiet_step(loading) if hasattr(show, "quiet_step") else show(loading, 0, 0)
            loaded = lead.instrument.load(lead)
        for ctx in ctxs:
            ctx.loaded = loaded
            ctx.instrument.check_loaded(ctx)
        said: list[str] = []  # the runner's lines wait until the display has closed (its last line is not "done")
        outcomes = _work(ctxs, resume=resume, announce=announce, show=show, say=said.append, command=command)
    for line in said:
        say(line)
    return outcomes


def _work(ctxs: list[Context], *, resume: bool, announce: bool, show, say, command=None) -> list[Outcome]:
    lead = ctxs[0]
    units: list[Unit] = lead.instrument.units(lead)
    plans = [(ctx, ctx.instrument.units(ctx) if ctx is not lead else units) for ctx in ctxs]
    keys = [u.key for u in units]
    for ctx, us in plans:
        if [u.key for u in us] != keys:
            raise InputError(
                f"{ctx.instrument.name} and {lead.instrument.name} split the work differently; run them separately"
            )
    if len(set(keys)) != len(keys):
        raise InputError(f"{lead.instrument.name}: two units share a key; every unit needs its own")
    values = [earlier_units(ctx, keys) if resume else {} for ctx in ctxs]
    for ctx, v in zip(ctxs, values):
        ctx.kept = dict(v)
    todo = [i for i, k in enumerate(keys) if not all(k in v for v in values)]
    sharded = lead.world > 1 and all(c.instrument.parallel == "units" for c in ctxs)
    # the one answer to which rank runs which units: a tensor-parallel group runs its units together
    place = placement(lead.loaded) if lead.instrument.needs_model else Placement.here()
    share, shares = place.unit_share()
    if sharded and any(c.instrument.chained for c in ctxs):
        mine = todo if share == 0 else []  # chained units: the first data rank (its whole group) runs them in order
    else:
        mine = todo[share::shares] if sharded else todo
    sites = sorted({s for c in ctxs for s in c.instrument.sites(c)})
    stats = set().union(*(c.instrument.stats(c) for c in ctxs))
    stage = lead.instrument.stage
    done0 = len(keys) - len(todo)
    found: list[dict] = [{} for _ in ctxs]
    interrupted = False
    try:
        for n, i in enumerate(mine):
            unit = units[i]
            recording = None
            if sites:  # one recording of the union of the sites, shared by every instrument
                from headlab.interpret.capture import capture

                extra = dict(lead.instrument.capture_options(lead))
                skw = {**extra.pop("stats_kwargs", {}), **({"stats": sorted(stats)} if stats else {})} or None
                try:
                    recording = capture(
                        lead.loaded, lead.instrument.unit_inputs(lead, unit), sites=sites, stats_kwargs=skw, **extra
                    )
                except HeadlabError as e:  # e.g. the memory guard: said in the instrument's words, with its advice
                    raise lead.instrument.recording_refused(lead, e) from None
            for j, (ctx, us) in enumerate(plans):
                if keys[i] not in values[j]:
                    found[j][keys[i]] = ctx.kept[keys[i]] = ctx.instrument.run_unit(ctx, us[i], recording)
            recording = None  # not held through the next unit, or through finish and write
            if announce and len(keys) > 1:  # rank 0's share under torchrun
                show(stage, done0 + n + 1, done0 + len(mine))
    except KeyboardInterrupt:
        interrupted = True
    if sharded:  # every rank's units, on every rank (one message), so rank 0 writes them all
        from headlab.distributed.data import gather_objects

        # a tensor-parallel group's ranks hold the same values: its first rank sends them, the others only their flag
        got = gather_objects((found if place.tensor_rank == 0 else [{} for _ in ctxs], interrupted))
        interrupted = any(flag for _, flag in got)
        found = [{k: v for part, _ in got for k, v in part[j].items()} for j in range(len(ctxs))]
    outcomes = []
    for j, ctx in enumerate(ctxs):
        kept = {k: (found[j][k] if k in found[j] else values[j][k]) for k in keys if k in found[j] or k in values[j]}
        outcomes.append(_close(ctx, kept, len(keys), interrupted, say, command))
    return outcomes


def placement(loaded) -> Placement:
    """The placement of what the load hook gave: a loaded model's or an adapter's; a bare module handed over from
    Python through its adapter (built once and kept on it), which knows the ranks that hold its heads."""
    import torch.nn

    if isinstance(loaded, torch.nn.Module) and not hasattr(loaded, "placement"):
        from headlab.models.loaded_model import adapt

        return Placement.of(adapt(loaded))
    return Placement.of(loaded)


def _close(ctx: Context, kept: dict, total: int, interrupted: bool, say, command: str | None = None) -> Outcome:
    inst = ctx.instrument
    if not ctx.main and not (ctx.python and not interrupted):  # from Python every rank gets the result (rank 0 writes)
        return Outcome(None, ctx.path, interrupted=interrupted, kept=len(kept), total=total, main=False, ctx=ctx)
    if interrupted:
        files: list[Path] = []
        if ctx.path is not None and kept and not writes_folder(ctx):
            ctx.path.parent.mkdir(parents=True, exist_ok=True)
            files = [partial_result(ctx, kept, total).save(partial_path(ctx))]
        elif ctx.path is not None and kept:  # a folder of the instrument's own files: it writes what it can
            ctx.path.mkdir(parents=True, exist_ok=True)
            files = inst.write_kept(ctx, kept, ctx.path)
            if inst.resumable:  # and the units, in the folder, for --resume
                files.append(partial_result(ctx, kept, total).save(partial_path(ctx)))
        again = f": {resume_line(command)}" if command else ""
        where = (
            f"in {files[0]}" + (f"; run again with --resume to finish the rest{again}" if inst.resumable else "")
            if files
            else "nothing was written" + ("" if kept else " (no unit had finished)")
        )
        say(f"interrupted: kept {len(kept)} of {total} units {where}")
        return Outcome(None, files[0] if files else None, files, interrupted=True, kept=len(kept), total=total, ctx=ctx)
    result = inst.finish(ctx, kept)
    if inst.resumable and inst.keeps_units and not writes_folder(ctx):
        result.figures[UNITS_KEY] = {k: inst.unit_to_json(v) for k, v in kept.items()}
        if to_json_value(result.settings) != to_json_value(ctx.settings):  # the result's own settings differ: the
            result.figures[UNITS_SETTINGS_KEY] = ctx.settings  # run's are kept beside its units, for --resume
    files = []
    if ctx.path is not None and ctx.main:
        assert inst.output is not None  # a path comes from the instrument's output
        (ctx.path if inst.output.folder and inst.output.file is None else ctx.path.parent).mkdir(
            parents=True, exist_ok=True
        )
        files = inst.write(ctx, result, ctx.path)
        if writes_folder(ctx):  # finished: the folder is the result, the units an interrupted run kept go
            partial_path(ctx).unlink(missing_ok=True)
    return Outcome(result, ctx.path, files, kept=len(kept), total=total, main=ctx.main, ctx=ctx)


def call(instrument: Instrument | str, options: dict, *, progress=None, resume: bool = False):
    """Run ``instrument`` for a library function and return what it computed: the library's own object
    (:attr:`InstrumentResult.native <headlab.interpret.study.base.InstrumentResult.native>`), else the
    result envelope.

    This is how :func:`headlab.head_importance`, :func:`headlab.ablate`, :func:`headlab.probe` and the other named
    functions run: the same checks, units, progress, rank split and recording as the command, with the options
    named as Python names them, a model handed over already loaded (``options["model"]``: a name, a folder, a
    loaded model, an adapter or a module), and inputs in memory (the instrument's ``python`` options). Under
    torchrun every rank returns the whole result. Nothing is said on the terminal; Ctrl-C raises
    ``KeyboardInterrupt`` as any Python call does (an output file, if one was asked for, keeps the finished units).
    """
    from headlab.interpret.study.base import InstrumentResult

    # resume: the units its output file keeps are read back (a library function's checkpoint, as --resume)
    quiet = lambda line: None  # nothing said on the terminal
    (outcome,) = run_together([(instrument, options)], resume=resume, progress=progress, say=quiet, python=True)
    if outcome.interrupted:
        raise KeyboardInterrupt
    result = outcome.result
    return result.native if isinstance(result, InstrumentResult) and result.native is not None else result


__all__ = [
    "INTERRUPTED_KEY",
    "UNITS_KEY",
    "call",
    "check_options",
    "check_tensor_parallel",
    "output_path",
    "run",
    "run_together",
]
