"""What every command writes to the terminal with: the two consoles, the exit code of Ctrl-C, the command line.

The rendering layer's shared state, apart from the commands (:mod:`headlab.cli.app`) and the rows
(:mod:`headlab.cli.rows`), so that both import it and neither imports the other.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

INTERRUPTED_EXIT = 130  # the shell's code for a process ended by Ctrl-C: every command exits with it


def _piped_width(stream) -> int | None:
    """Rich draws 80 columns when output is not a terminal, cutting table cells; piped output (a log,
    a file, ``| less``) gets a wide page instead, unless ``COLUMNS`` says otherwise."""
    return None if os.environ.get("COLUMNS") or stream.isatty() else 200


console = Console(width=_piped_width(sys.stdout))
err_console = Console(stderr=True, width=_piped_width(sys.stderr))
INTERRUPTED_BEFORE = "interrupted before any work was done; nothing was written"  # Ctrl-C before the units
invoked: list[str] = []  # the arguments of the running command line (headlab.cli.main.main sets them)

__all__ = ["INTERRUPTED_BEFORE", "INTERRUPTED_EXIT", "console", "err_console", "invoked"]
