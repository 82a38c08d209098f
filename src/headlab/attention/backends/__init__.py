"""Attention backends, one module (or package) each, in a registry. Importing this package
registers them: ``reference``, ``sdpa``, ``tiled``, ``sparse``, ``linear``."""

from headlab.attention.backends import linear, reference, sdpa, sparse, tiled  # noqa: F401  (registration)
from headlab.attention.backends.base import (
    Backend,
    Capabilities,
    choose,
    exact_names,
    get,
    is_exact,
    names,
    register,
    require,
)

__all__ = ["Backend", "Capabilities", "choose", "exact_names", "get", "is_exact", "names", "register", "require"]
