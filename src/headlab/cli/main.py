"""Entry point of the ``headlab`` command: a table of commands, one module each."""

from __future__ import annotations

import sys
from importlib import import_module

from headlab.attention.backends.native import enabled as native_enabled
from headlab.attention.memory_guard import memory_limit_override
from headlab.cli.app import app, err_console
from headlab.errors import CLI_EXIT_CODE, HeadlabError

# Each module registers its commands on the app when imported.
COMMANDS = ["costs_cmd", "backends_cmd", "models_cmd", "demo", "bench", "pattern", "analyze", "probe", "heads", "flow", "explain", "train", "generate", "atlas",
            "patch"]
for _name in COMMANDS:
    import_module(f"headlab.cli.{_name}")


def main(argv: list[str] | None = None) -> None:
    """Run the CLI. A headlab error becomes one line on stderr and exit code 2.

    The environment is read first (``HEADLAB_MEMORY_LIMIT``, ``HEADLAB_NATIVE``), so a bad value
    stops the command before any work.
    """
    try:
        memory_limit_override()
        native_enabled()
        app(args=argv, prog_name="headlab")
    except HeadlabError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(CLI_EXIT_CODE)


if __name__ == "__main__":
    main()
