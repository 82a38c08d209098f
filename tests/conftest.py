"""What the tests share: :func:`run_cli`, the ``headlab`` command's real entry point inside a test, and
:func:`require` with its two users :func:`require_native` and :func:`require_browser`.

The tests folder is put on ``sys.path`` here, so a test module imports it with ``from conftest import
run_cli`` (pytest runs with ``--import-mode=importlib``, which does not add it by itself).

Skips that CI must not take
---------------------------
A test that needs something a machine may lack (the C++ compiler that builds the native kernel, a
headless Chromium) calls ``require(condition, reason)``: on a developer's machine a missing
prerequisite skips the test with the reason; under CI (``CI=true``, as ``.ci/run`` sets it) it
*fails* it, because ``.ci/run`` installs both and a skip there would silently stop testing the
kernel or the pages. Optional extras that CI does not promise (a GPU, captum, networkx) keep a plain
``pytest.skip`` / ``pytest.importorskip``.

``HEADLAB_NATIVE=0`` (a deliberate switch-off of the kernel) fails under CI too: the kernel's tests
exist to compare it with the PyTorch paths, and a CI that sets the switch would pass without ever
building it. The failure names the switch (``native.error()`` says "disabled by HEADLAB_NATIVE=0"),
so the fix is plain: unset it in CI, or leave ``CI`` unset to run the PyTorch paths alone.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Chromium-like browsers, looked for on PATH in this order after $HEADLAB_CHROMIUM.
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


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


@pytest.fixture
def no_load(monkeypatch):
    """Any model load fails the test: the command (or the runner) must refuse before it."""
    def boom(*a, **k):
        raise AssertionError("a model was loaded before the bad option was refused")

    import headlab
    import headlab.models
    import headlab.models.loader

    monkeypatch.setattr(headlab, "load", boom)  # first: headlab caches its lazy names, so it must cache the real one
    monkeypatch.setattr(headlab.models.loader, "load", boom)
    monkeypatch.setattr(headlab.models, "load", boom)


def command_params(*path: str) -> dict:
    """The click parameters of ``headlab PATH...`` (``command_params("heads", "prune")``), by name."""
    import typer

    import headlab.cli.main  # noqa: F401  (registers every command)
    from headlab.cli.app import app

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return {p.name: p for p in cmd.params}


def save_word_level(folder, model, words: list[str]):
    """Save ``model`` with a whitespace word-level tokenizer over ``words`` (``words[0]`` the pad token,
    ``words[1]`` the unknown one) into ``folder``, so that ``headlab.load(folder)`` reads text offline."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[1]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=words[0], unk_token=words[1])
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def in_ci() -> bool:
    """Whether this run is CI's: ``CI=true`` in the environment (any letter case)."""
    return os.environ.get("CI", "").strip().lower() == "true"


def require(condition, reason: str) -> None:
    """Go on when ``condition`` holds; else skip the calling test with ``reason``, or fail it under CI.

    See the module docstring for which prerequisites take this rule and why.
    """
    if condition:
        return
    if in_ci():
        pytest.fail(f"{reason}. CI=true: CI provides this (.ci/run installs g++ and Chromium), so the test "
                    "fails here instead of skipping; run without CI=true to skip it", pytrace=False)
    pytest.skip(reason)


def require_native():
    """The compiled native kernel's module (:func:`headlab.attention.backends.native.kernel`), or
    :func:`require`'s skip / CI failure saying whether it was switched off or could not be built."""
    from headlab.attention.backends import native

    mod = native.kernel()
    if not native.enabled():
        reason = "the native kernel is switched off (HEADLAB_NATIVE=0); unset HEADLAB_NATIVE to build and test it"
    else:
        reason = (f"the native kernel could not be built ({native.error()}); it needs a C++ compiler "
                  "(apt-get install g++) and ninja")
    require(mod is not None, reason)
    return mod


def find_browser() -> str | None:
    """``$HEADLAB_CHROMIUM`` or the first Chromium-like browser on PATH (see :data:`BROWSERS`)."""
    env = os.environ.get("HEADLAB_CHROMIUM")
    if env:
        return env
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


def require_browser() -> str:
    """The path of a headless Chromium (:func:`find_browser`), or :func:`require`'s skip / CI failure."""
    path = find_browser()
    require(path is not None, f"no headless Chromium found (looked for {', '.join(BROWSERS)} on PATH and "
                              "$HEADLAB_CHROMIUM); install one, e.g. `apt-get install chromium`")
    return path


# -- the architecture sweep's table: served / refused / by which check -------------------------------------------
# tests/test_architectures.py and tests/test_structure.py record each swept type through the ``sweep`` fixture;
# a type whose sweep test fails is recorded as failing, with the assertion. At the end of the run the table is
# printed (only for the types that ran).
_SWEEP: dict[str, tuple[str, str]] = {}
_SWEEP_TESTS = ("test_every_step", "test_refused_architectures_say_why",
                "test_unservable_structures_are_refused_with_what_was_found")


def refusal_check(message: str) -> str:
    """The check a refusal names (``check 'pattern'``), else its reason: the message's first clause after the
    model type, at most 110 characters."""
    import re

    hit = re.search(r"failed the load-time check '(\w+)'", message)
    if hit:
        return f"check '{hit.group(1)}'"
    why = message.split("': ", 1)[-1].split(";")[0]
    return why if len(why) <= 110 else why[:107] + "..."


@pytest.fixture
def sweep():
    """``sweep(name, verdict, why)``: record one swept architecture for the end-of-run table (``verdict`` is
    ``"served"`` or ``"refused"``; ``why`` the check, or what a served type refuses, typed)."""
    def record(name: str, verdict: str, why: str = "") -> None:
        _SWEEP[name] = (verdict, why)
    return record


def pytest_runtest_logreport(report):
    """A failing sweep test: its type is recorded as failing, with the last assertion line."""
    if report.when != "call" or not report.failed or "[" not in report.nodeid:
        return
    test, name = report.nodeid.split("::")[-1].split("[", 1)
    if test in _SWEEP_TESTS:
        lines = [ln[1:].strip() for ln in str(report.longrepr).splitlines() if ln.startswith("E ")]
        _SWEEP[name.rstrip("]")] = ("FAILED", (lines[-1] if lines else "")[:110])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _SWEEP:
        return
    counts = {v: sum(1 for verdict, _ in _SWEEP.values() if verdict == v) for v in ("served", "refused", "FAILED")}
    tr = terminalreporter
    tr.write_sep("-", "architectures: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n)
                 + " (served / refused / by which check)")
    width = max(len(n) for n in _SWEEP)
    for verdict in ("served", "refused", "FAILED"):
        for name in sorted(n for n, (v, _) in _SWEEP.items() if v == verdict):
            tr.write_line(f"{verdict:8s} {name:{width}s}  {_SWEEP[name][1]}".rstrip())
