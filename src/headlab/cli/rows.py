"""CLI commands as rows: a typer command built from an instrument's declared options, calling the runner.

``row(app, "flow", "flow")`` adds ``headlab flow`` to ``app``: one typer parameter per
:class:`~headlab.interpret.study.base.Option` (an argument when it has no flag; ``--x/--no-x`` for a
bool with an off switch; none for a Python-only one), plus ``--resume`` for a resumable instrument and ``--tensor-parallel`` / ``--tensor-size``
for one that runs on a model sharded by heads (under torchrun). The command hands the options to
:func:`headlab.interpret.study.runner.run` (checks, reading, loading, progress, Ctrl-C, writing) and the
instrument renders the outcome. A run interrupted by Ctrl-C exits 130 after the runner's one line.

Typer reads a command's parameters from its signature, so the command is one function taking ``**options``
whose ``__signature__`` is built here from ``inspect.Parameter``s whose defaults are ``typer.Option(...)``.
"""

from __future__ import annotations

import inspect

import typer

from headlab.cli.terminal import INTERRUPTED_BEFORE, INTERRUPTED_EXIT, console, err_console, invoked
from headlab.distributed.placement import TensorParallel
from headlab.interpret.study.base import ENVELOPE_JSON, REQUIRED, Instrument, Option, get
from headlab.results import print_json


def _parameter(o: Option) -> inspect.Parameter:
    default = ... if o.default is REQUIRED else o.default
    if o.flag is None:
        info = typer.Argument(default, help=o.help)
    else:
        names = [f"{o.flag}/{o.off}" if o.off else o.flag, *o.aliases] + ([o.short] if o.short else [])
        info = typer.Option(default, *names, help=o.help)
    return inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=o.type)


def command(instrument: Instrument | str):
    """The typer callback of ``instrument``: its parameters are the declared options (and ``--resume``)."""
    inst = get(instrument) if isinstance(instrument, str) else instrument
    params = [_parameter(o) for o in inst.options if not o.python]  # Python-only options have no flag
    if inst.needs_model and inst.sharded is True:
        params += [
            inspect.Parameter(
                "tensor_parallel",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=bool,
                default=typer.Option(
                    False,
                    "--tensor-parallel",
                    help="under torchrun: shard the model by heads over the ranks with "
                    "transformers' tensor parallelism (torchrun --nproc_per_node 2 -m headlab ... --tensor-parallel)",
                ),
            ),
            inspect.Parameter(
                "tensor_size",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=int,
                default=typer.Option(
                    None,
                    "--tensor-size",
                    help="with --tensor-parallel: ranks per tensor-parallel group (a divisor of "
                    "the world size; the groups split the work, a (data, tensor) mesh); default every rank",
                ),
            ),
        ]
    if inst.resumable:
        params.append(
            inspect.Parameter(
                "resume",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=bool,
                default=typer.Option(
                    False, "--resume", help="keep the units already in the output file and compute only the rest"
                ),
            )
        )

    def run_row(**options) -> None:
        from headlab.interpret.study.runner import run

        resume = bool(options.pop("resume", False))
        envelope = any(o is ENVELOPE_JSON for o in inst.options) and bool(options.get("as_json"))
        tp = TensorParallel.from_flags(bool(options.pop("tensor_parallel", False)), options.pop("tensor_size", None))
        try:
            outcome = run(
                inst,
                options,
                resume=resume,
                progress=True,
                transient=True,
                say=lambda line: err_console.print(line, highlight=False, soft_wrap=True),
                tensor_parallel=tp,
                command=_command_line(invoked),
            )
        except KeyboardInterrupt:  # Ctrl-C before the units (reading, loading): nothing computed, nothing written
            err_console.print(INTERRUPTED_BEFORE, highlight=False)
            raise typer.Exit(INTERRUPTED_EXIT) from None
        if outcome.interrupted:
            raise typer.Exit(INTERRUPTED_EXIT)
        if outcome.main and envelope and outcome.result is not None:  # --json of an instrument without its own
            print_json(outcome.result.to_json())
        elif outcome.main:
            from headlab.cli.views import render

            assert outcome.ctx is not None  # the main rank's outcome carries its context
            render(outcome.ctx, outcome, console, err_console)

    run_row.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # typer reads it: the row's options
    run_row.__name__ = f"{inst.name.replace('-', '_')}_cmd"
    run_row.__doc__ = inst.summary or inst.__doc__
    return run_row


def _command_line(argv: list[str] | None) -> str | None:
    """The command line as a shell would take it back (``headlab`` and the arguments, quoted where needed); None
    when the row was not started by :func:`headlab.cli.main.main` (then the Ctrl-C line names no command)."""
    import shlex

    return " ".join(["headlab", *map(shlex.quote, argv)]) if argv else None


def row(app: typer.Typer, name: str, instrument: Instrument | str) -> None:
    """Add the command ``name`` to ``app``, running ``instrument``."""
    inst = get(instrument) if isinstance(instrument, str) else instrument
    app.command(name, help=inspect.cleandoc(inst.summary or inst.__doc__ or ""))(command(inst))


__all__ = ["INTERRUPTED_EXIT", "command", "row"]
