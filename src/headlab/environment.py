"""The environment variables headlab reads, checked before any work (the command line reads them first).

``HEADLAB_MEMORY_LIMIT`` (a byte size: the memory guard's budget) and ``HEADLAB_NATIVE`` (0 or 1: whether the
compiled attention kernel is used). The base layer: standard library only, so a command refuses a bad value
without importing torch.

    >>> import os
    >>> os.environ["HEADLAB_MEMORY_LIMIT"] = "512M"; memory_limit_override()
    536870912
    >>> del os.environ["HEADLAB_MEMORY_LIMIT"]; memory_limit_override() is None
    True
"""

from __future__ import annotations

import os

from headlab.errors import ConfigError
from headlab.units import parse_bytes

__all__ = ["memory_limit_override", "native_enabled"]


def memory_limit_override() -> int | None:
    """``HEADLAB_MEMORY_LIMIT`` in bytes (None when unset or empty); a value that is not a size
    raises :class:`~headlab.errors.ConfigError` naming the variable."""
    raw = os.environ.get("HEADLAB_MEMORY_LIMIT", "")
    if not raw.strip():
        return None
    n = parse_bytes(raw)
    if n is None:
        raise ConfigError(
            f"HEADLAB_MEMORY_LIMIT={raw!r} is not a size; give bytes (17179869184) or a size "
            "such as 16GiB, 512M, 1.5G (powers of 1024), or unset it"
        )
    return n


def native_enabled() -> bool:
    """``HEADLAB_NATIVE``: ``1`` (or unset) uses the kernel, ``0`` keeps the PyTorch paths;
    any other value is a :class:`~headlab.errors.ConfigError` (the CLI reads it before any work)."""
    raw = os.environ.get("HEADLAB_NATIVE", "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(
            f"HEADLAB_NATIVE={raw!r} is not 0 or 1; set HEADLAB_NATIVE=0 to use the PyTorch paths "
            "only, 1 (or unset it) to use the compiled kernel"
        )
    return raw != "0"
