"""Every ```python block of README.md and docs/*.md runs as written, each on its own.

A block preceded by a line ``<!-- not-run: REASON -->`` is reported as a skip with that reason
(it needs data or a cached model); one preceded by ``<!-- slow -->`` runs with ``make test-slow``.
```console blocks (shell sessions) are not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*(not-run:\s*(?P<reason>.*?)|(?P<slow>slow))\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the not-run reason
    slow: bool

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file, with the marker line just before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if lang == "python":
            prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
            mark = _MARK.match(prev.strip())
            out.append(Block(path, start + 1, "\n".join(lines[start + 1:j]) + "\n",
                             skip=(mark.group("reason") or "not run") if mark and not mark.group("slow") else None,
                             slow=bool(mark and mark.group("slow"))))
        i = j + 1
    return out


BLOCKS = [b for f in FILES for b in python_blocks(f)]


def _param(b: Block):
    marks = [pytest.mark.slow] if b.slow else []
    return pytest.param(b, id=b.id, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_code_block_runs(block: Block, tmp_path, monkeypatch):
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    code = compile(block.code, str(block.path), "exec")
    # line numbers in a traceback point into the Markdown file
    code = code.replace(co_firstlineno=block.line + 1)
    exec(code, {"__name__": "__docs__"})


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
