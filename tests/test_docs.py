"""Every ```python block and every ```console command of README.md and docs/*.md runs as written.

A python block runs on its own, in a fresh folder. A console block is a shell session: its ``$ ``
lines (with the bodies of their here-documents) run in order as one bash script in a fresh folder,
with the ``headlab`` of this environment first on PATH; the other lines are the output shown, not
checked. Every command must exit 0, except one whose block is marked ``<!-- exit: N -->``, which
must exit N (the documented refusals).

A block preceded by ``<!-- not-run: REASON -->`` is reported as a skip with that reason (it needs a
second machine or data a fresh install cannot have); ``<!-- slow -->`` runs with ``make test-slow``;
``<!-- needs-classifier -->`` runs when the SST-2 classifier ``headlab train-classifier`` makes is in
headlab's cache (skipped with that reason otherwise).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*(not-run:\s*(?P<reason>.*?)|(?P<slow>slow)|(?P<clf>needs-classifier)|exit:\s*(?P<exit>\d+))"
                   r"\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the not-run reason
    slow: bool
    needs_classifier: bool = False
    exit: int = 0  # the exit status a console block's last command must have

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _marks(lines: list[str], start: int) -> dict:
    """The marker lines (``<!-- ... -->``) just above line ``start``."""
    found: dict = {}
    k = start - 1
    while k >= 0 and (not lines[k].strip() or _MARK.match(lines[k].strip())):
        m = _MARK.match(lines[k].strip())
        if m:
            for key, v in m.groupdict().items():
                if v is not None:
                    found.setdefault(key, v)
        elif found:
            break
        k -= 1
    return found


def _blocks(path: Path, lang: str) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if m.group(1) == lang:
            mk = _marks(lines, start)
            skip = mk.get("reason") or ("not run" if "reason" in mk else None)
            out.append(Block(path, start + 1, "\n".join(lines[start + 1:j]) + "\n", skip=skip, slow="slow" in mk,
                             needs_classifier="clf" in mk, exit=int(mk.get("exit", 0))))
        i = j + 1
    return out


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file, with the marker lines just before each."""
    return _blocks(path, "python")


def console_script(code: str) -> str:
    """The commands of a console block as a bash script: ``$ `` lines and their here-document bodies."""
    lines, out, i = code.splitlines(), [], 0
    while i < len(lines):
        ln = lines[i]
        i += 1
        if not ln.startswith("$ "):
            continue  # output shown in the docs
        cmd = ln[2:]
        out.append(cmd)
        here = re.search(r"<<-?\s*'?(\w+)'?", cmd)
        if here:
            while i < len(lines):
                out.append(lines[i])
                i += 1
                if lines[i - 1].strip() == here.group(1):
                    break
    return "\n".join(out) + "\n"


def console_blocks(path: Path) -> list[Block]:
    """The ```console blocks that hold commands (``$ `` lines)."""
    return [b for b in _blocks(path, "console") if console_script(b.code).strip()]


BLOCKS = [b for f in FILES for b in python_blocks(f)]


def _param(b: Block):
    marks = [pytest.mark.slow] if b.slow else []
    return pytest.param(b, id=b.id, marks=marks)


def _skip_without_classifier(block: Block) -> None:
    from headlab.models.finetune import default_folder

    if block.needs_classifier and not (default_folder() / "config.json").is_file():
        pytest.skip(f"{block.id}: needs the SST-2 classifier at {default_folder()} (headlab train-classifier "
                    "--data FOLDER_WITH_SST2, 10 to 25 min on 2 cores)")


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_code_block_runs(block: Block, tmp_path, monkeypatch):
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    _skip_without_classifier(block)
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    # a block that registers a backend (docs/attention.md's "mine") keeps it to itself, not for later tests
    from headlab.attention.backends import base
    from headlab.costs import model as cost_model

    for mod, name in ((base, "_REGISTRY"), (cost_model, "_FORMULAS"), (cost_model, "_BACKENDS")):
        monkeypatch.setattr(mod, name, dict(getattr(mod, name)))
    code = compile(block.code, str(block.path), "exec")
    # line numbers in a traceback point into the Markdown file
    code = code.replace(co_firstlineno=block.line + 1)
    exec(code, {"__name__": "__docs__"})


CONSOLE = [b for f in FILES for b in console_blocks(f)]


@pytest.mark.parametrize("block", [_param(b) for b in CONSOLE])
def test_console_block_runs(block: Block, tmp_path):
    """The block's commands, as a new user types them (``set -e``: each must succeed)."""
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    _skip_without_classifier(block)
    script = console_script(block.code)
    lines = script.rstrip("\n").split("\n")
    body = "set -euo pipefail\n" + script
    if block.exit:  # the last command is the documented refusal
        last = lines[-1]
        body = "set -euo pipefail\n" + "\n".join(lines[:-1]) + f"\nset +e\n{last}\nrc=$?\n" \
            f"[ $rc -eq {block.exit} ] || {{ echo \"exit $rc, documented {block.exit}\" >&2; exit 99; }}\n"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HEADLAB_PROGRESS": "plain", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(["bash", "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{block.id}: exit {proc.returncode}\n{script}\n--- stderr ---\n{proc.stderr[-3000:]}"


def test_console_script_extraction():
    code = "$ cat > a.txt <<'EOF'\nx\n$ not a prompt inside\nEOF\noutput line\n$ headlab memory --seq-len 8\n│ table │\n"
    assert console_script(code) == "cat > a.txt <<'EOF'\nx\n$ not a prompt inside\nEOF\nheadlab memory --seq-len 8\n"


def test_blocks_are_found():
    """The extraction itself: the README's mechanism block is there, console blocks are not."""
    readme = python_blocks(ROOT / "README.md")
    assert any("headlab.attention(q, k, v" in b.code for b in readme)
    assert all("$ headlab" not in b.code for b in BLOCKS)


def test_markers(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("```python\na = 1\n```\n\n<!-- not-run: needs the SST-2 classifier -->\n```python\nb = 2\n```\n"
                  "<!-- slow -->\n```python\nc = 3\n```\n```console\n$ headlab demo\n```\n")
    got = [(b.line, b.skip, b.slow) for b in python_blocks(md)]
    assert got == [(1, None, False), (6, "needs the SST-2 classifier", False), (10, None, True)]
