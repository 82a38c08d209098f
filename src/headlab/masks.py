"""``headlab.masks``: mask functions (see :mod:`headlab.attention.masks`)."""

from headlab.attention.masks import *  # noqa: F401,F403
from headlab.attention.masks import __all__  # noqa: F401
