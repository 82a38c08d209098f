"""Progress has one owner (``headlab.progress``) and one protocol, ``progress(stage, done, total)``.

What the display prints (plain lines with an estimate, a heartbeat in a silent phase), what a library
function's ``progress=`` takes (True, False/None or the callable; older one-argument forms through an
adapter), and that no other module builds a display of its own."""

from __future__ import annotations

import ast
import io
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from headlab import progress as P
from headlab.errors import ConfigError

SRC = Path(__file__).resolve().parents[1] / "src" / "headlab"


class Clock:
    """A fake ``time.perf_counter``: the test moves it."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_plain_lines_say_how_long_is_left(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(P.time, "perf_counter", clock)
    buf = io.StringIO()
    with P.Stages(P.PlainProgress(stream=buf, every=1000)) as say:
        say("sentences", 0, 10)
        clock.t += 10
        say("sentences", 5, 10)  # 0.5 per second: 10 s left
        clock.t += 10
        say("sentences", 10, 10)
    assert buf.getvalue().splitlines() == ["sentences: 0/10 (0%) 0.0 s",
                                           "sentences: 5/10 (50%) 10.0 s, about 10 s left",
                                           "sentences: 10/10 (100%) 20.0 s, done"]


def test_a_resumed_stage_estimates_from_this_run(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(P.time, "perf_counter", clock)
    buf = io.StringIO()
    with P.Stages(P.PlainProgress(stream=buf, every=1000)) as say:
        say("rows", 50, 100)  # 50 done by an earlier run
        clock.t += 10
        say("rows", 70, 100)  # 2 rows a second in this run: 15 s left (not 4 s, as if all 70 took 10 s)
    assert "rows: 70/100 (70%) 10.0 s, about 15 s left" in buf.getvalue()


def test_a_silent_phase_still_prints_a_line_every_few_seconds():
    """The heartbeat: a phase that takes minutes between steps says it is alive (every ``every`` seconds)."""
    buf = io.StringIO()
    with P.Stages(P.PlainProgress(stream=buf, every=0.2)) as say:
        say("repeated tokens", 0, 1)
        time.sleep(1.0)
        say("repeated tokens", 1, 1)
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("repeated tokens: 0/1 (0%)") and lines[-1].endswith(", done")
    assert len([ln for ln in lines if ln.startswith("repeated tokens: 0/1")]) >= 3, lines
    n = len(lines)
    time.sleep(0.5)  # closed: the heartbeat has stopped
    assert len(buf.getvalue().splitlines()) == n


def test_steps_of_unknown_length_end_when_the_next_starts():
    buf = io.StringIO()
    display = P.PlainProgress(stream=buf, every=1000)
    with P.Stages(display) as say:
        say("loading model minilm", 0, 0)
        say("writing the page", 0, 0)
    lines = buf.getvalue().splitlines()
    assert [re.sub(r"[\d.]+ s", "T", ln) for ln in lines] == ["loading model minilm: T", "writing the page: T"]
    assert all(t.finished for t in display.tasks.values())  # nothing left running for the heartbeat


def test_reporter_takes_one_family():
    seen = []
    with P.reporter(lambda stage, done, total: seen.append((stage, done, total))) as say:
        say("rows", 1, 2)
    assert seen == [("rows", 1, 2)]
    for off in (False, None, 0):
        with P.reporter(off) as say:
            say("rows", 1, 2)  # nothing, no display
            assert say is P._nothing
    with P.reporter(True) as say:
        assert isinstance(say, P.Stages)
    with pytest.raises(ConfigError, match=r"progress must be True, False or a callable progress\(stage, done, total\)"):
        with P.reporter("yes"):
            pass


def test_older_one_argument_forms_go_through_an_adapter():
    got = []
    with P.reporter(got.append, legacy=P.increments) as say:
        for done in (0, 3, 5, 5, 9):
            say("max flow", done, 9)
    assert got == [3, 2, 4]
    msgs = []
    with P.reporter(msgs.append, legacy=P.messages) as say:
        say("loading", 0, 0)
        say("loading", 1, 0)
        say("drawing", 0, 0)
    assert msgs == ["loading", "drawing"]
    three = []
    with P.reporter(lambda stage, done, total=0: three.append(stage), legacy=P.messages) as say:
        say("a", 1, 1)  # three parameters (one with a default) is the protocol itself
    assert three == ["a"]


def test_flow_values_takes_the_protocol_and_the_older_form():
    from headlab.interpret.flow.maxflow import flow_values

    A = np.random.default_rng(0).random((2, 5, 5))
    A /= A.sum(-1, keepdims=True)
    calls = []
    flow_values(A, 0, 2, progress=lambda stage, done, total: calls.append((stage, done, total)))
    assert calls[0] == ("max flow", 0, 5) and calls[-1] == ("max flow", 5, 5)
    steps = []
    flow_values(A, 0, 2, progress=steps.append)  # the older progress(k): sinks solved since the last call
    assert sum(steps) == 5


def test_patching_reports_each_configuration():
    import headlab
    from headlab.interpret.patching import logit_diff
    from headlab.models.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    m = Transformer(TransformerConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, causal=True)).eval()
    clean, corrupt = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
    calls = []
    headlab.patch(m, clean, corrupt, logit_diff(2, 5), progress=lambda *a: calls.append(a))
    assert calls[0] == ("patching", 0, 4) and calls[-1] == ("patching", 4, 4)


def _progress_parameters():
    """(module, function, annotation) of every function with a ``progress`` parameter under ``src/headlab``."""
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for a in node.args.args + node.args.kwonlyargs:
                    if a.arg == "progress":
                        yield (str(path.relative_to(SRC)), node.name,
                               ast.unparse(a.annotation) if a.annotation else None)


# functions of other rooms whose progress= still takes an older form (their owners migrate them)
OLDER_FORMS = {"attention/measure.py": "bench_attention", "models/finetune.py": "train_classifier"}


def test_every_progress_parameter_takes_the_one_family():
    family = {"bool", "bool | Progress", "bool | Progress | None", None}  # None: a private helper's pass-through
    odd = [f"{m}:{fn} takes {ann}" for m, fn, ann in _progress_parameters()
           if ann not in family and OLDER_FORMS.get(m) != fn]
    assert not odd, "\n".join(odd)


def test_no_other_module_builds_a_progress_display():
    """rich's progress classes and PlainProgress are built in headlab/progress.py only; others call it."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "progress.py":
            continue
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module == "rich.progress":
                bad.append(f"{path.relative_to(SRC)} imports rich.progress")
            elif isinstance(node, ast.ClassDef) and "progress" in node.name.lower() or \
                    isinstance(node, ast.FunctionDef) and node.name in ("progress_bar", "stage_bar", "step_printer"):
                bad.append(f"{path.relative_to(SRC)} defines {node.name}")
    assert not bad, "\n".join(bad)
