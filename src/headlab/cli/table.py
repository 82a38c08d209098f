"""The command table: every instrument is a command, found in the registry, loaded when it runs.

An instrument (``headlab.interpret.study.base.Instrument``) declares its command (``command``, default its
``name``; ``"heads importance"`` puts it under the ``heads`` group). This module turns the registry into the
CLI's rows without importing the instruments, so ``headlab --help`` and the plain commands (``memory``) start
without torch or transformers:

* **Shipped instruments** are read from their source with :mod:`ast` (the class under ``@register``: its
  ``name``, ``command`` and ``summary``), in the instrument homes listed in :data:`HOMES`; a command runs by
  importing its module, which registers the class, and building its row (:func:`headlab.cli.rows.command`).
* **Instruments registered at run time** (a plug-in, a test's toy instrument defined in one file) are rows too:
  whatever the registry holds when the command line is parsed, if the registry is already imported.

:class:`CommandGroup` is the click group of ``headlab`` (and of ``headlab heads``): its commands are the plain
ones registered with ``@app.command()`` plus the table's, listed in that order; ``--help`` shows a table entry
from its summary without importing its module (as litgpt's command table, or click's lazily loaded
subcommands).
"""

from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib import import_module
from pathlib import Path

from typer.core import TyperGroup

#: where instruments live (a package: every module in it; a module: itself); the same as
#: ``headlab.interpret.study.base.HOMES`` (a test checks), written here so that ``--help`` imports no torch
HOMES = (
    "headlab.interpret.instruments",
    "headlab.interpret.report.instrument",
    "headlab.decode.instrument",
    "headlab.decode.gates_instrument",
    "headlab.decode.suite_instrument",
    "headlab.decode.disagree_instrument",
    "headlab.decode.quant_error_instrument",
)
_NOT_INSTRUMENTS = {"__init__"}
_BASE = "headlab.interpret.study.base"


@dataclass(frozen=True)
class Entry:
    """One instrument's row: ``command`` (words), the registry ``name``, the module that registers it, the help."""

    command: tuple[str, ...]
    name: str
    module: str | None  # None: registered at run time (already imported)
    help: str


def _home_files() -> list[tuple[str, Path]]:
    root = Path(__file__).resolve().parents[1]  # the headlab package
    files = []
    for home in HOMES:
        rel = Path(*home.split(".")[1:])
        if (root / rel).is_dir():
            files += [
                (f"{home}.{p.stem}", p) for p in sorted((root / rel).glob("*.py")) if p.stem not in _NOT_INSTRUMENTS
            ]
        else:
            files.append((home, root / rel.with_suffix(".py")))
    return files


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def _read_source(module: str, path: Path) -> list[Entry]:
    """The instruments registered in ``path``, read without running it."""
    entries = []
    for cls in ast.parse(path.read_text(encoding="utf-8")).body:
        if not isinstance(cls, ast.ClassDef) or not any(
            (d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)) == "register" for d in cls.decorator_list
        ):
            continue
        values = {}
        for stmt in cls.body:
            target = (
                stmt.targets[0]
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                else getattr(stmt, "target", None)
            )
            if isinstance(target, ast.Name) and getattr(stmt, "value", None) is not None:
                values[target.id] = _literal(stmt.value)  # type: ignore[attr-defined]  # an Assign or AnnAssign: both have it (checked above)
        name = values.get("name")
        if isinstance(name, str):
            command = values.get("command") or name
            text = values.get("summary") or ast.get_docstring(cls) or ""
            entries.append(Entry(tuple(command.split()), name, module, inspect.cleandoc(text)))
    return entries


@lru_cache(maxsize=1)
def shipped() -> tuple[Entry, ...]:
    """Every shipped instrument's row, read from the sources once."""
    return tuple(e for module, path in _home_files() for e in _read_source(module, path))


def entries() -> list[Entry]:
    """The shipped rows, and any instrument registered at run time that declares a command of its own."""
    rows = list(shipped())
    base = sys.modules.get(_BASE)  # nothing registers an instrument without importing the contract
    if base is not None:
        known = {e.name for e in rows}
        for inst in base.registered():
            if inst.name not in known and inst.command is not None:
                text = inspect.cleandoc(inst.summary or inst.__doc__ or "")
                rows.append(Entry(tuple((inst.command or inst.name).split()), inst.name, None, text))
    return rows


class _Listed:
    """A stand-in for a command in the help's list: its name and help, without its module."""

    def __init__(self, name: str, help: str) -> None:
        self.name, self.help, self.short_help, self.hidden, self.deprecated = name, help, None, False, False


class _Commands(dict):
    """A group's commands: those added so far, and the table's, built the first time they are looked up."""

    def __init__(self, group: CommandGroup, commands: dict) -> None:
        super().__init__(commands)
        self.group = group

    def __missing__(self, name: str):
        cmd = self.group.resolve(name)
        if cmd is None:
            raise KeyError(name)
        return cmd

    def get(self, name, default=None):
        try:
            return self[name]
        except KeyError:
            return default


class CommandGroup(TyperGroup):
    """A click group whose commands come from the table as well as from ``@app.command()``.

    ``path``: the words before this group's commands (``()`` for ``headlab``; :func:`group` makes the class of a
    named group, ``group("heads")`` for ``headlab heads``).
    """

    path: tuple[str, ...] = ()
    commands: _Commands  # click's dict of commands, wrapped: built from the table on first use

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands(self, self.commands)
        self._listing = False

    def _table(self) -> dict[str, list[Entry]]:
        """This group's rows by their next word (one entry: a command; more words: a group of them)."""
        out: dict[str, list[Entry]] = {}
        n = len(self.path)
        for e in entries():
            if len(e.command) > n and e.command[:n] == self.path:
                out.setdefault(e.command[n], []).append(e)
        return out

    def list_commands(self, ctx) -> list[str]:
        names = list(dict.keys(self.commands))
        return names + [w for w in self._table() if w not in names]

    def get_command(self, ctx, cmd_name: str):
        if dict.__contains__(self.commands, cmd_name):
            return dict.__getitem__(self.commands, cmd_name)
        rows = self._table().get(cmd_name)
        if not rows:
            return None
        if self._listing and len(rows) == 1 and len(rows[0].command) == len(self.path) + 1:
            return _Listed(cmd_name, rows[0].help)
        return self.commands.get(cmd_name)

    def resolve(self, cmd_name: str):
        """Build the table's command ``cmd_name`` (a group when its rows have more words) and keep it."""
        rows = self._table().get(cmd_name)
        if not rows:
            return None
        n = len(self.path) + 1
        if any(len(e.command) > n for e in rows):
            cmd = group(*self.path, cmd_name)(
                name=cmd_name, no_args_is_help=True, help=", ".join(" ".join(e.command[n - 1 :]) for e in rows)
            )
        else:
            cmd = build(rows[0])
        dict.__setitem__(self.commands, cmd_name, cmd)
        return cmd

    def format_help(self, ctx, formatter) -> None:
        self._listing = True  # the list of commands shows summaries; nothing is imported for it
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


def group(*path: str) -> type[CommandGroup]:
    """The group class of ``headlab PATH...`` (``typer.Typer(cls=group("heads"))``): its commands are the table's
    rows under ``PATH`` as well as its own."""
    return type(f"CommandGroup_{'_'.join(path)}", (CommandGroup,), {"path": tuple(path)})


def build(entry: Entry):
    """The click command of a table row: import its module (which registers the instrument) and build the row."""
    import typer

    if entry.module is not None:
        import_module(entry.module)
    from headlab.cli.rows import command
    from headlab.interpret.study.base import get

    inst = get(entry.name)
    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    one.command(entry.command[-1], help=entry.help)(command(inst))
    return typer.main.get_command(one)


__all__ = ["HOMES", "CommandGroup", "Entry", "build", "entries", "group", "shipped"]
