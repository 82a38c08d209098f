"""Named checks for the values a user gives: counts, sizes, fractions, choices.

One place says what a count must be, in the manner of the named validators of PyTorch's
``flex_attention.py``: a check takes the value's name and the value, returns the value (an integer as ``int``)
or raises a typed error from :mod:`headlab.errors` that names the value, says what was seen and what to give.
Settings are refused with :class:`~headlab.errors.ConfigError` (the default); pass ``error=InputError`` for
a value that is an input rather than a setting.

``True`` is an int to Python, but never a count: every integer check refuses a bool. NaN and infinity are
refused wherever a number is bounded::

    >>> positive_int("max_new_tokens", 8)
    8
    >>> positive_int("max_new_tokens", True)
    Traceback (most recent call last):
    ...
    headlab.errors.ConfigError: max_new_tokens must be a positive integer, got True
    >>> at_least("--width", 0, 1, what=" character")
    Traceback (most recent call last):
    ...
    headlab.errors.ConfigError: --width must be at least 1 character, got 0
    >>> one_of("mode", "fast", ("exact", "approx"))
    Traceback (most recent call last):
    ...
    headlab.errors.ConfigError: unknown mode 'fast'; choose one of exact, approx

Every check builds its message as ``"{name} must be {expected}{what}, got {value}{hint}"``: ``what`` qualifies
what is expected (``" (rows per forward)"``), ``hint`` follows the value (``"; 1000 is the default"``). Where
a command's message has its own wording, ``message`` replaces it: a ``str.format`` template given the fields
``name``, ``value`` (as given, so ``{value!r}`` and ``{value:,}`` work) and the check's bounds (``low``,
``high``, :func:`index`'s ``length``, :func:`one_of`'s ``choices``).

This module is in the base layer: it imports :mod:`headlab.errors` and the standard library only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

from headlab.errors import ConfigError


def is_int(value) -> bool:
    """An integer (a Python or NumPy one) that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number (int or float, NaN and infinity included) that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _seen(value) -> str:
    return str(value) if is_number(value) else repr(value)


def _refuse(error, message, expected, name, value, what, hint, **fields) -> Exception:
    if message is not None:
        return error(message.format(name=name, value=value, **fields))
    return error(f"{name} must be {expected}{what}, got {_seen(value)}{hint}")


def integer(name: str, value, *, what: str = "", hint: str = "", error=ConfigError, message: str | None = None) -> int:
    """An integer of any sign (a seed, a class id)."""
    if not is_int(value):
        raise _refuse(error, message, "an integer", name, value, what, hint)
    return int(value)


def int_in_range(
    name: str,
    value,
    low: int,
    high: int,
    *,
    what: str = "",
    hint: str = "",
    error=ConfigError,
    message: str | None = None,
) -> int:
    """An integer with ``low <= value <= high`` (both ends included)."""
    if not is_int(value) or not low <= value <= high:
        raise _refuse(error, message, f"an integer in {low}..{high}", name, value, what, hint, low=low, high=high)
    return int(value)


def int_at_least(
    name: str, value, low: int, *, what: str = "", hint: str = "", error=ConfigError, message: str | None = None
) -> int:
    """An integer ``>= low``."""
    if not is_int(value) or value < low:
        raise _refuse(error, message, f"an integer >= {low}", name, value, what, hint, low=low)
    return int(value)


def positive_int(
    name: str, value, *, what: str = "", hint: str = "", error=ConfigError, message: str | None = None
) -> int:
    """An integer ``>= 1`` (a count, a size)."""
    if not is_int(value) or value < 1:
        raise _refuse(error, message, "a positive integer", name, value, what, hint, low=1)
    return int(value)


def non_negative_int(
    name: str, value, *, what: str = "", hint: str = "", error=ConfigError, message: str | None = None
) -> int:
    """An integer ``>= 0`` (a count that may be none)."""
    if not is_int(value) or value < 0:
        raise _refuse(error, message, "an integer >= 0", name, value, what, hint, low=0)
    return int(value)


def index(
    name: str,
    value,
    length: int,
    *,
    negative: bool = True,
    what: str = "",
    hint: str = "",
    error=ConfigError,
    message: str | None = None,
) -> int:
    """An index into ``length`` items, returned in ``0..length - 1``; ``negative`` allows ``-length..-1``
    counted from the end, as Python's indexing does."""
    low = -length if negative else 0
    if not is_int(value) or not low <= value < length:
        span = f"{low}..{length - 1}" if length else "none: there is nothing to index"
        raise _refuse(
            error,
            message,
            f"an index into {length} items ({span})",
            name,
            value,
            what,
            hint,
            low=low,
            high=length - 1,
            length=length,
        )
    return int(value) % length


def number(name: str, value, *, what: str = "", hint: str = "", error=ConfigError, message: str | None = None):
    """A real number, an int or a float (NaN and infinity pass: bound it with :func:`in_range` or
    :func:`finite_float`)."""
    if not is_number(value):
        raise _refuse(error, message, "a number", name, value, what, hint)
    return value


def at_least(name: str, value, low, *, what: str = "", hint: str = "", error=ConfigError, message: str | None = None):
    """A finite number ``>= low`` (an int or a float; use :func:`int_at_least` where only an integer fits)."""
    ok = is_number(value) and (is_int(value) or math.isfinite(value)) and value >= low
    if not ok:  # infinity is at least anything: say it is the finiteness that fails
        finite = not is_number(value) or is_int(value) or math.isfinite(value)
        expected = f"at least {low}" if finite else f"a finite number of at least {low}"  # inf and NaN: not a setting
        raise _refuse(error, message, expected, name, value, what, hint, low=low)
    return value


def finite_float(
    name: str, value, *, what: str = "", hint: str = "", error=ConfigError, message: str | None = None
) -> float:
    """A finite number (NaN and infinity refused), returned as a float."""
    if not is_number(value) or (not is_int(value) and not math.isfinite(value)):
        raise _refuse(error, message, "a finite number", name, value, what, hint)
    return float(value)


def positive_float(
    name: str, value, *, what: str = "", hint: str = "", error=ConfigError, message: str | None = None
) -> float:
    """A finite number ``> 0`` (a rate, a size in bytes per second), returned as a float."""
    if not is_number(value) or not 0 < value < math.inf:
        raise _refuse(error, message, "a positive finite number", name, value, what, hint, low=0)
    return float(value)


def in_range(
    name: str,
    value,
    low,
    high,
    *,
    low_open: bool = False,
    high_open: bool = False,
    what: str = "",
    hint: str = "",
    error=ConfigError,
    message: str | None = None,
):
    """A number between ``low`` and ``high``, each end included unless ``low_open``/``high_open``
    (``in_range("dropout_p", p, 0, 1, high_open=True)`` is ``0 <= p < 1``); NaN is refused."""
    ok = (
        is_number(value)
        and (low < value if low_open else low <= value)
        and (value < high if high_open else value <= high)
    )
    if not ok:
        span = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise _refuse(error, message, f"a number in {span}", name, value, what, hint, low=low, high=high)
    return value


def probability(name: str, value, *, what: str = "", hint: str = "", error=ConfigError, message: str | None = None):
    """A number in ``[0, 1]`` (a share, a fraction kept, a probability)."""
    return in_range(name, value, 0, 1, what=what, hint=hint, error=error, message=message)


def one_of(name: str, value, choices: Iterable, *, error=ConfigError, message: str | None = None):
    """One of ``choices`` (compared with ``==``; a bool is never taken for 0 or 1)."""
    choices = tuple(choices)
    if isinstance(value, bool) and not any(isinstance(c, bool) for c in choices) or value not in choices:
        listed = ", ".join(str(c) for c in choices)
        if message is not None:
            raise error(message.format(name=name, value=value, choices=listed))
        raise error(f"unknown {name} {value!r}; choose one of {listed}")
    return value


def boolean(name: str, value, *, what: str = "", hint: str = "", error=ConfigError, message: str | None = None) -> bool:
    """``True`` or ``False`` (not 0, 1 or a string that reads as one)."""
    if not isinstance(value, bool):
        raise _refuse(error, message, "True or False", name, value, what, hint)
    return value


__all__ = [
    "at_least",
    "boolean",
    "finite_float",
    "in_range",
    "index",
    "int_at_least",
    "int_in_range",
    "integer",
    "is_int",
    "is_number",
    "non_negative_int",
    "number",
    "one_of",
    "positive_float",
    "positive_int",
    "probability",
]
