"""Where headlab keeps files it derives once and reuses: :func:`cache_dir`.

``$HEADLAB_CACHE`` when set, else ``$XDG_CACHE_HOME/headlab``, else ``~/.cache/headlab``. Nothing in
it is downloaded: it holds what headlab computed from installed packages or a user's own runs (a
dequantised model, a fine-tuned classifier), each in a sub-folder named after what it holds.

    >>> import os
    >>> os.environ["HEADLAB_CACHE"] = "/tmp/hl-cache-doctest"
    >>> str(cache_dir("minilm-sst2"))
    '/tmp/hl-cache-doctest/minilm-sst2'
    >>> del os.environ["HEADLAB_CACHE"]
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from headlab.errors import ConfigError


def cache_dir(*parts: str) -> Path:
    """The cache folder (or a path inside it, ``cache_dir("smollm2")``); created on first write, not here."""
    root = os.environ.get("HEADLAB_CACHE")
    if root:
        base = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "headlab"
    return base.joinpath(*parts)


def writable_cache_dir(*parts: str) -> Path:
    """:func:`cache_dir`, created and checked writable before any long work writes into it;
    :class:`~headlab.errors.ConfigError` naming the folder and the variable to set otherwise."""
    path = cache_dir(*parts)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as e:
        where = "HEADLAB_CACHE" if os.environ.get("HEADLAB_CACHE") else "the cache folder"
        raise ConfigError(
            f"{where} {path.parent} is not writable ({e.strerror or e}); set HEADLAB_CACHE to a "
            "folder you can write, e.g. HEADLAB_CACHE=/tmp/headlab-cache"
        ) from None
    return path
