"""What the tests share: :func:`run_cli`, the ``headlab`` command's real entry point inside a test.

The tests folder is put on ``sys.path`` here, so a test module imports it with ``from conftest import
run_cli`` (pytest runs with ``--import-mode=importlib``, which does not add it by itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def run_cli(args, capsys) -> tuple[int, str, str]:
    """Run ``headlab ARGS`` through its entry point (with its error rule); ``capsys`` is pytest's fixture.

    Returns ``(exit code, stdout, stderr)``.
    """
    from headlab.cli.main import main

    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out = capsys.readouterr()
    return code, out.out, out.err
