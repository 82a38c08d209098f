"""The native engine (``headlab.attention.backends.native``): the one owner of the compiled kernel.

Its decision (:func:`native.declines`), composed band masks on the kernel's fast path against the
reference (the FlashAttention error rule of :func:`headlab.testing.compare_backend`), and that no
other module calls the raw kernel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import require_native
from headlab import masks
from headlab.attention.backends import native
from headlab.spec.attention_spec import validate
from headlab.testing import compare_backend

ROOT = Path(__file__).resolve().parent.parent


def _qkv(lq=300, lk=300, h=4, hkv=2, d=16, dv=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, h, lq, d, generator=g, dtype=dtype), torch.randn(2, hkv, lk, d, generator=g, dtype=dtype),
            torch.randn(2, hkv, lk, dv, generator=g, dtype=dtype))


def _spy(monkeypatch) -> dict:
    """Count the engine's forward and backward calls."""
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        real = getattr(native, name)

        def wrapped(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(native, name, wrapped)
    return calls


# composed masks that are one band around the diagonal: the kernel's window fast path takes them
COMPOSED = [
    ("causal_and_window", masks.causal() & masks.sliding_window(40), False),
    ("window_and_is_causal", masks.sliding_window(25), True),  # sparse walks the mask ANDed with causal()
    ("overlapping_windows", masks.sliding_window(8) | masks.sliding_window(30, causal=True), False),
    ("window_minus_far_future", masks.sliding_window(50) & ~(~masks.causal() & ~masks.sliding_window(5)), False),
]


@pytest.mark.parametrize("backend", ["tiled", "sparse"])
@pytest.mark.parametrize("name,mask,causal", COMPOSED, ids=[c[0] for c in COMPOSED])
def test_composed_window_takes_the_kernel_and_matches_the_reference(backend, name, mask, causal, monkeypatch):
    require_native()
    q, k, v = _qkv()
    spec, norm = validate(q, k, v, mask=mask, causal=causal)
    assert native.declines(spec, norm, torch.float32) is None
    calls = _spy(monkeypatch)
    report = compare_backend(backend, q, k, v, mask=mask, causal=causal)
    assert report.ok, report.failures()
    assert calls["forward"] >= 1 and calls["backward"] >= 1, calls  # the kernel ran, forward and backward


def test_composed_window_statistics_take_the_kernel(monkeypatch):
    require_native()
    q, k, v = _qkv()
    mask = masks.causal() & masks.sliding_window(40)
    calls = []
    real = native.statistics
    monkeypatch.setattr(native, "statistics", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    import headlab

    st = headlab.attention_stats(q, k, v, mask=mask)
    assert calls == [1]
    w = headlab.attention_weights(q.double(), k.double(), mask=mask)
    torch.testing.assert_close(st.max_weight.double(), w.amax(-1), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(st.received.double(), w.sum(-2), atol=2e-5, rtol=2e-5)


# calls the kernel declines, each with its reason (the callers then run their PyTorch paths)
DECLINED = [
    ("float64", dict(dtype=torch.float64), {}, "float32"),
    ("future_band", dict(mask=~masks.causal() & masks.sliding_window(3)), {}, "band of offsets"),
    ("two_bands", dict(mask=masks.sliding_window(1) | ~masks.sliding_window(5)), {}, "band of offsets"),
    ("plain_function", dict(mask=masks.as_mask(lambda b, h, q, kv: q >= kv)), {}, "band of offsets"),
    ("dropout", {}, dict(dropout_p=0.1), "dropout"),
    ("score_mod", {}, dict(score_mod=masks.softcap(20.0)), "score_mod"),
    ("own_tiles", {}, dict(own_tiles=True), "tile sizes"),
]


@pytest.mark.parametrize("name,call,opts,reason", DECLINED, ids=[c[0] for c in DECLINED])
def test_declines_says_why(name, call, opts, reason):
    q, k, v = _qkv(lq=20, lk=20, dtype=call.get("dtype", torch.float32))
    spec, norm = validate(q, k, v, mask=call.get("mask"))
    ct = torch.float64 if spec.dtype == torch.float64 else torch.float32
    why = native.declines(spec, norm, ct, **opts)
    assert why is not None and reason in why, why


def test_declines_under_a_dispatch_mode():
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = _qkv(lq=20, lk=20)
    spec, _ = validate(q, k, v)
    with FlopCounterMode(display=False):
        assert "dispatch mode" in native.declines(spec, None, torch.float32)


def test_only_the_engine_calls_the_raw_kernel():
    """``mod.onepass(...)`` and ``mod.onepass_backward(...)`` appear in exactly one module: the engine."""
    for call in ("onepass", "onepass_backward"):
        pattern = re.compile(r"\." + call + r"\(")
        callers = sorted(str(p.relative_to(ROOT)) for folder in ("src", "benchmarks") for p in (ROOT / folder).rglob("*.py")
                         if pattern.search(p.read_text(encoding="utf-8")))
        assert callers == ["src/headlab/attention/backends/native.py"], (call, callers)


# -- how the kernel is found: built at install (setup.py), imported, never compiled at run time ------------


@pytest.fixture
def fresh(monkeypatch):
    """The engine as a new process finds it: nothing loaded, nothing refused yet."""
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.delenv("HEADLAB_NATIVE", raising=False)
    return monkeypatch


def test_the_kernel_is_the_installed_extension_and_nothing_is_compiled(fresh):
    """kernel() imports the extension setup.py built; torch's JIT loader is never called."""
    import torch.utils.cpp_extension as cpp

    calls = []
    for name in ("load", "load_inline"):
        fresh.setattr(cpp, name, lambda *a, _name=name, **kw: calls.append(_name))
    mod = require_native()
    assert calls == []
    assert mod.__name__ == native.EXTENSION == "headlab.attention.backends._onepass"
    assert Path(mod.__file__).parent == Path(native.__file__).parent  # beside the engine, not a build cache
    assert mod.source_tag == f"headlab-onepass-source:sha1_{native.source_hash()}"
    assert native.built_from(native.installed()) == native.source_hash()
    jit = re.compile(r"cpp_extension import|import torch\.utils\.cpp_extension|cpp_extension\.load")
    compiling = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*.py")
                       if jit.search(p.read_text(encoding="utf-8")))
    assert compiling == []  # no module compiles at run time


def test_a_new_process_loads_the_kernel_without_building_it(tmp_path):
    """A fresh interpreter with an empty build cache gets the kernel at once: no build, no lock file
    (the JIT build wrote both under TORCH_EXTENSIONS_DIR; a second checkout rebuilt, a killed build
    blocked every later process)."""
    import os
    import subprocess
    import sys

    require_native()
    cache = tmp_path / "torch_extensions"
    cache.mkdir()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "HOME": str(tmp_path)}
    env.pop("HEADLAB_NATIVE", None)
    code = ("from headlab.attention.backends import native; m = native.kernel(); "
            "print(m.__name__ if m is not None else native.error())")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == native.EXTENSION, run.stdout + run.stderr
    assert "compiling" not in run.stderr
    assert list(cache.iterdir()) == []


def test_a_stale_kernel_is_refused_before_it_is_loaded(fresh, tmp_path, capsys):
    """An extension built from another version of its sources (codes.cpp edited after install) is
    not loaded: the PyTorch paths stand in and error() says how to rebuild."""
    if native.installed() is None:
        pytest.skip("no installed kernel to find stale")
    edited = tmp_path / "codes.cpp"
    edited.write_bytes(native._SOURCES[1].read_bytes() + b"\n// edited after install\n")
    fresh.setattr(native, "_SOURCES", (native._SOURCES[0], edited))
    imported = []
    real = native.importlib.import_module
    fresh.setattr(native.importlib, "import_module", lambda name, *a: imported.append(name) or real(name, *a))
    assert native.kernel() is None
    assert imported == []  # refused from the file's tag, before loading it
    why = native.error()
    assert "was built from another version of its sources, csrc/onepass.cpp and codes.cpp" in why, why
    assert "re-run `pip install -e . --no-build-isolation` (or `make venv`)" in why, why
    assert "not using the compiled attention kernel" in capsys.readouterr().err
    q, k, v = _qkv(lq=20, lk=20)
    spec, norm = validate(q, k, v)
    assert native.declines(spec, norm, torch.float32).startswith("it is not built: ImportError: the installed kernel")
    import headlab

    st = headlab.attention_stats(q, k, v, causal=True)  # the PyTorch path answers
    w = headlab.attention_weights(q.double(), k.double(), causal=True)
    torch.testing.assert_close(st.max_weight.double(), w.amax(-1), atol=2e-5, rtol=2e-5)


def test_a_kernel_file_without_its_tag_is_refused(fresh, tmp_path):
    """A truncated or foreign extension file (a build cut short) carries no source hash: refused."""
    broken = tmp_path / "_onepass.cpython-311-x86_64-linux-gnu.so"
    broken.write_bytes(b"\x7fELF" + b"\0" * 64)
    fresh.setattr(native, "installed", lambda: broken)
    assert native.built_from(broken) is None
    assert native.kernel() is None
    assert "carries no source hash" in native.error() and "--no-build-isolation" in native.error()


def test_no_installed_kernel_says_how_to_build_it(fresh):
    """Without a compiler the install skipped the extension: the PyTorch paths stand in, and error() says why."""
    fresh.setattr(native, "installed", lambda: None)
    assert native.kernel() is None
    why = native.error()
    assert "is not installed" in why and "no C++ compiler" in why and "--no-build-isolation" in why, why


def test_headlab_native_0_still_switches_it_off(fresh):
    fresh.setenv("HEADLAB_NATIVE", "0")
    fresh.setattr(native, "installed", lambda: pytest.fail("HEADLAB_NATIVE=0 must not look for the kernel"))
    assert native.kernel() is None
    assert native.error() == "disabled by HEADLAB_NATIVE=0"
