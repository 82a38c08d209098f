"""The house's structure, read from the source with ``ast``: imports point one way and never in a circle.

Layers, lowest first:

    spec  <-  costs  <-  attention  <-  distributed  <-  models  <-  interpret  <-  decode  <-  cli

``spec`` is what a cost formula may read: what attention is asked to compute (the spec, masks, tile states,
block maps, visibility, score mods, feature maps and the memory guard). ``attention`` holds the engines: the
backends, the statistics, the functional core, the module and measurement. Backends import ``costs`` (each
declares its formula), so ``costs`` sits between the two folders and imports no engine. A module may import its own layer and the layers below it, never one above (function-level
imports included: a lazy import is still a dependency). Inside ``interpret``, ``capture`` and ``shell``
(the one HTML shell every page uses) are at the bottom and ``report`` at the top: nothing but ``report``
itself and ``cli`` imports ``report``, ``shell`` imports no other room of ``interpret``, and ``study`` (the
study runner and its contract, which the rooms' functions call) imports none but ``capture``. ``errors``,
``_version``, ``units``, ``progress``, ``tsv``, ``results`` and ``outputs`` sit below everything; the package root may import
anything (it is the public façade), and nothing in the package imports the root.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "headlab"
LAYERS = ["spec", "costs", "attention", "distributed", "models", "interpret", "decode", "cli"]
BASE = {"errors", "_version", "units", "progress", "tsv", "results", "outputs", "reading", "checks", "registry", "environment", "locks"}  # importable from every layer
MAX_LINES = 460  # "no source file above about 450 lines"


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _is_module(dotted: str) -> bool:
    p = SRC.parent / Path(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _imports(name: str, path: Path) -> set[str]:
    """Every headlab module ``name`` imports (absolute and relative, at any depth of the file)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    pkg = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "headlab")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "headlab":
                continue
            subs = {f"{mod}.{a.name}" for a in node.names}  # `from headlab.x import y` may import submodule y
            found.update(subs)
            if not all(_is_module(m) for m in subs):  # names defined in mod itself (not only its submodules)
                found.add(mod)
    return found


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = {_resolve(t, modules) for t in _imports(name, path)}
        graph[name] = {d for d in deps if d and d != name}
    return graph


def _layer(module: str) -> tuple[int, str | None]:
    parts = module.split(".")
    if len(parts) == 1:
        return (99, None)  # the root façade
    top = parts[1]
    if top in BASE:
        return (-1, None)
    if top in LAYERS:
        room = parts[2] if top == "interpret" and len(parts) > 2 else None
        return (LAYERS.index(top), room)
    return (len(LAYERS) - 0.5, None)  # other top-level modules (testing, masks shim): above the layers, below the root


def test_no_upward_import():
    bad = []
    for mod, deps in _graph().items():
        lm, room = _layer(mod)
        for d in deps:
            ld, droom = _layer(d)
            if ld == 99 and lm != 99:
                bad.append(f"{mod} imports the package root")
            elif ld > lm and lm != 99:
                bad.append(f"{mod} (layer {lm}) imports {d} (layer {ld})")
            elif lm == ld == LAYERS.index("interpret") and droom == "report" and room != "report":
                bad.append(f"{mod} imports {d}: nothing below report imports report")
            elif lm == ld == LAYERS.index("interpret") and room == "capture" and droom not in (None, "capture"):
                bad.append(f"{mod} imports {d}: capture sits at the bottom of interpret")
            elif lm == ld and room == "shell" and droom not in (None, "shell"):
                bad.append(f"{mod} imports {d}: the shell sits at the bottom of interpret")
            elif lm == ld and room == "study" and droom not in (None, "study", "capture"):
                bad.append(f"{mod} imports {d}: the study runner sits below the rooms whose functions call it")
    assert not bad, "\n".join(sorted(bad))


def _packages_graph(graph):
    """Edges between folders (a module's parent package), which is what the structure drawing shows."""
    def folder(m):
        if (SRC.parent / Path(*m.split("."))).is_dir():
            return m
        return m.rpartition(".")[0]
    pg: dict[str, set[str]] = {}
    for m, deps in graph.items():
        pg.setdefault(folder(m), set()).update(folder(d) for d in deps if folder(d) != folder(m))
    return pg


@pytest.mark.parametrize("level", ["modules", "folders"])
def test_no_import_cycle(level):
    graph = _graph()
    graph.pop("headlab", None)  # the root façade only re-exports
    for deps in graph.values():
        deps.discard("headlab")
    if level == "folders":
        graph = _packages_graph(graph)
        # a folder's __init__ importing its own children is not a cycle between folders
        def related(a, b):
            return a == b or a.startswith(b + ".") or b.startswith(a + ".")
        graph = {k: {d for d in v if not related(k, d)} for k, v in graph.items()}
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        color[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if color.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if color.get(d) is None:
                visit(d)
        stack.pop()
        color[n] = 2

    for n in sorted(graph):
        if color.get(n) is None:
            visit(n)


def test_no_source_file_is_too_long():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"files above {MAX_LINES} lines (split them along their seams): {long}"


def test_the_checker_sees_a_violation(tmp_path):
    """The checker itself: an upward import written in a file is found."""
    p = tmp_path / "x.py"
    p.write_text("def f():\n    from headlab.cli.app import app\n")
    assert "headlab.cli.app" in _imports("headlab.attention.x", p)
    assert _layer("headlab.attention.x")[0] < _layer("headlab.cli.app")[0]
