"""Entry point of the ``headlab`` command.

The commands are the instruments of the registry (:mod:`headlab.cli.table`, each imported when it runs) and the
plain commands of :data:`COMMANDS` (one module each, importing their library inside the command): so ``headlab
--help``, ``headlab memory`` and every refusal that needs no model start without importing transformers.
"""

from __future__ import annotations

import sys
from importlib import import_module

import typer
from rich.markup import escape

from headlab.cli.app import app, err_console, invoked
from headlab.cli.terminal import INTERRUPTED_BEFORE, INTERRUPTED_EXIT
from headlab.environment import memory_limit_override, native_enabled
from headlab.errors import CLI_EXIT_CODE, HeadlabError

try:  # typer >= 0.2x carries its own click, whose errors derive from typer.TyperException; older ones raise click's
    from click.exceptions import ClickException as _ClickException
except ImportError:  # pragma: no cover
    _ClickException = None  # type: ignore[misc, assignment]  # no click: no such class
PARSE_ERRORS = tuple({e for e in (getattr(typer, "TyperException", None), _ClickException) if e is not None})

# The plain commands: each module registers its commands on the app when imported (the instruments' rows come
# from the command table).
COMMANDS = ["costs_cmd", "backends_cmd", "models_cmd", "demo", "bench", "heads", "train"]
for _name in COMMANDS:
    import_module(f"headlab.cli.{_name}")


def main(argv: list[str] | None = None) -> None:
    """Run the CLI. A headlab error becomes one line on stderr and exit code 2.

    The environment is read first (``HEADLAB_MEMORY_LIMIT``, ``HEADLAB_NATIVE``), so a bad value
    stops the command before any work.
    """
    invoked[:] = list(sys.argv[1:] if argv is None else argv)
    try:
        memory_limit_override()
        native_enabled()
        code = app(args=argv, prog_name="headlab", standalone_mode=False)  # parse errors come back to us
    except HeadlabError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(CLI_EXIT_CODE)
    except PARSE_ERRORS as e:
        sys.exit(_parse_error(e))
    except KeyboardInterrupt:  # Ctrl-C outside the units (reading, loading): nothing was computed yet
        err_console.print(INTERRUPTED_BEFORE, highlight=False)
        sys.exit(INTERRUPTED_EXIT)
    except typer.Abort as e:  # click turns Ctrl-C into Abort too: the shell's 130, as in the units
        if isinstance(e.__cause__, KeyboardInterrupt) or isinstance(e.__context__, KeyboardInterrupt):
            err_console.print(INTERRUPTED_BEFORE, highlight=False)
            sys.exit(INTERRUPTED_EXIT)
        err_console.print("Aborted!", highlight=False)  # end of input at a prompt
        sys.exit(1)
    if isinstance(code, int) and not isinstance(code, bool) and code:  # typer.Exit(n), Ctrl-C (130)
        sys.exit(code)


def _parse_error(e: Exception) -> int:
    """A command line click cannot parse (an unknown option or command, a missing argument, ``--top x``): one
    line on stderr saying what and where the options are, and exit code 2, as for every other headlab error.
    With no arguments at all, typer has already shown the help (on stdout), as before."""
    if type(e).__name__ == "NoArgsIsHelpError":
        return getattr(e, "exit_code", CLI_EXIT_CODE)
    ctx = getattr(e, "ctx", None)
    where = f"; see '{ctx.command_path} --help'" if ctx is not None else "; see 'headlab --help'"
    message = " ".join((e.format_message() if hasattr(e, "format_message") else str(e)).split()).rstrip(".")
    err_console.print(f"[bold red]error:[/] {escape(message + where)}", highlight=False, soft_wrap=True)
    return CLI_EXIT_CODE


if __name__ == "__main__":
    main()
