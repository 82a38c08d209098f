"""Attention backends, one file each, in a registry. Importing this package registers them."""

from headlab.attention.backends import reference, sdpa  # noqa: F401  (registration)
from headlab.attention.backends.base import Backend, Capabilities, choose, get, names, register, require

__all__ = ["Backend", "Capabilities", "choose", "get", "names", "register", "require"]

# Backends contributed by later work register themselves here, one import each.
for _mod in ("tiled", "sparse", "linear"):
    try:
        __import__(f"headlab.attention.backends.{_mod}")
    except ModuleNotFoundError as _e:  # not written yet
        if _e.name != f"headlab.attention.backends.{_mod}":
            raise
