"""The shared test helpers of tests/conftest.py: :func:`conftest.require` skips a test on a developer's
machine and fails it under CI; and the prerequisites CI promises are really there when CI runs."""

from __future__ import annotations

import pytest

import conftest
from conftest import in_ci, require, require_browser, require_native


@pytest.mark.parametrize("value, ci", [("true", True), ("TRUE", True), (" true ", True), ("1", False), ("", False),
                                       ("false", False), (None, False)])
def test_in_ci_reads_the_ci_variable(value, ci, monkeypatch):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert in_ci() is ci


def test_require_goes_on_when_the_condition_holds(monkeypatch):
    for env in ("true", ""):
        monkeypatch.setenv("CI", env)
        assert require(True, "never shown") is None


def test_require_skips_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"^no frobnicator here$"):
        require(False, "no frobnicator here")


def test_require_fails_under_ci_and_says_why(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception) as info:
        require(False, "no frobnicator here")
    msg = str(info.value)
    assert msg.startswith("no frobnicator here. CI=true:") and "fails here instead of skipping" in msg
    assert "run without CI=true to skip it" in msg
    assert info.value.pytrace is False  # one clear line, not a traceback into the helper


def test_a_switched_off_kernel_fails_under_ci_naming_the_switch(monkeypatch):
    """HEADLAB_NATIVE=0 is a deliberate switch-off; CI still fails, and says which switch did it."""
    from headlab.attention.backends import native

    monkeypatch.setattr(native, "kernel", lambda: None)
    monkeypatch.setenv("HEADLAB_NATIVE", "0")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"switched off \(HEADLAB_NATIVE=0\); unset HEADLAB_NATIVE"):
        require_native()
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match=r"switched off \(HEADLAB_NATIVE=0\)"):
        require_native()


def test_a_failed_build_fails_under_ci_with_the_build_error(monkeypatch):
    from headlab.attention.backends import native

    monkeypatch.setattr(native, "kernel", lambda: None)
    monkeypatch.setattr(native, "error", lambda: "RuntimeError: Error building extension: no g++")
    monkeypatch.delenv("HEADLAB_NATIVE", raising=False)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"could not be built \(RuntimeError: Error building extension: "
                                                    r"no g\+\+\); it needs a C\+\+ compiler"):
        require_native()


def test_a_missing_browser_fails_under_ci(monkeypatch):
    monkeypatch.setattr(conftest, "find_browser", lambda: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"no headless Chromium found .*apt-get install chromium"):
        require_browser()


def test_find_browser_prefers_headlab_chromium(monkeypatch):
    monkeypatch.setenv("HEADLAB_CHROMIUM", "/opt/my/chromium")
    assert conftest.find_browser() == "/opt/my/chromium"


# -- what CI promises (.ci/run installs a C++ compiler and Chromium): skipped here, failed in CI -----------------


def test_the_native_kernel_builds_and_runs():
    """The compiled kernel loads (else: skipped, or failed under CI with the build error or the switch),
    and the statistics it serves match the plain softmax map on one small causal call; the kernel's
    own comparisons with the PyTorch paths are in tests/test_stats.py."""
    import torch

    import headlab

    assert require_native() is not None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 33, 8, generator=g) for _ in range(3))  # (B, H, L, D)
    st = headlab.attention_stats(q, k, v, causal=True)
    w = headlab.attention_weights(q.double(), k.double(), causal=True)  # (B, H, Lq, Lk)
    torch.testing.assert_close(st.output.double(), w @ v.double(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(st.max_weight.double(), w.amax(-1), atol=2e-5, rtol=2e-5)


def test_a_headless_chromium_is_found():
    import subprocess

    browser = require_browser()
    proc = subprocess.run([browser, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "chrom" in proc.stdout.lower(), (proc.stdout, proc.stderr)
