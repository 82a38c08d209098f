"""Builds headlab's compiled one-pass attention kernel at install time (docs/native.md, "Building it").

Everything else about the package is in pyproject.toml; this file only adds the C++ extension
``headlab.attention.backends._onepass`` from ``src/headlab/attention/backends/csrc/onepass.cpp`` and ``codes.cpp``,
compiled by torch's own ``torch.utils.cpp_extension`` (``CppExtension`` / ``BuildExtension``)
against the torch already installed, so headlab is installed without build isolation (an
isolated build would fetch a torch of its own)::

    pip install torch==2.13.0 'setuptools>=77' wheel ninja
    pip install --no-build-isolation -e .          # the Makefile's `make venv` does both

The extension is optional: with no C++ compiler, or no torch in the build environment, the
install still succeeds with a warning and headlab runs on its PyTorch paths
(``headlab.attention.backends.native.error()`` says why). The extension carries the SHA-1 of the
sources it was compiled from; ``native.kernel()`` refuses one whose hash is not the sources'.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

from setuptools import setup

NAME = "headlab.attention.backends._onepass"
SOURCES = ["src/headlab/attention/backends/csrc/onepass.cpp", "src/headlab/attention/backends/csrc/codes.cpp"]
HERE = Path(__file__).resolve().parent


def _warn(msg: str) -> None:
    print(f"WARNING: headlab: {msg}; headlab will run on its PyTorch paths (docs/native.md)",
          file=sys.stderr, flush=True)


def _flags() -> list[str]:
    """The flags the JIT build used (-O3 -march=native -fopenmp, torch's CPU_CAPABILITY for
    ATen's Vectorized), no debug information, and the source's hash (native.source_hash())."""
    import torch

    digest = hashlib.sha1(b"".join((HERE / s).read_bytes() for s in SOURCES)).hexdigest()
    flags = ["-O3", "-march=native", "-fopenmp", "-g0", f"-DHEADLAB_SOURCE_SHA1=sha1_{digest}"]
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        flags += [f"-DCPU_CAPABILITY={cap}", f"-DCPU_CAPABILITY_{cap}"]
    return flags


def _extension() -> tuple[list, dict]:
    """``(ext_modules, cmdclass)``: the kernel's extension, or nothing when torch is not importable."""
    # numpy may not be installed yet (it is one of headlab's dependencies): torch's warning about it is noise here
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        _warn(f"torch is not importable while building ({exc}), so the compiled kernel is not built; "
              "install torch first and headlab with `pip install --no-build-isolation -e .`")
        return [], {}

    class OptionalBuildExtension(BuildExtension):
        """torch's BuildExtension, whose failure (no compiler, a compile error) is a warning."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any failure leaves the PyTorch paths, never a failed install
                _warn(f"could not build the compiled attention kernel ({type(exc).__name__}: {exc})")

        def copy_file(self, infile, outfile, *args, **kwargs):
            """The editable install's copy of the built module beside native.py, made atomic: a
            process that has the old one loaded keeps it, and a copy cut short leaves no partial file."""
            outfile = str(outfile)
            tmp = str(Path(outfile).with_name(f".partial-{os.getpid()}-{Path(outfile).name}"))  # *.so: git ignores it
            try:
                super().copy_file(infile, tmp, *args, **kwargs)
                os.replace(tmp, outfile)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return outfile, 1

    ext = CppExtension(NAME, SOURCES, extra_compile_args=_flags(), optional=True)
    return [ext], {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = _extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
