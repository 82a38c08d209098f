"""One registry type for every extension point (in the manner of transformers' ``GeneralInterface``).

A :class:`Registry` holds the named objects of one kind, in registration order: the attention backends, the
model families, the atlas kinds, the KV rules and stores, the instruments and the report sections. Each
object answers to one or more names (``key``: its ``name`` by default); a registry refuses a nameless object
or a name already taken, and a lookup of an unknown name raises a typed error that lists the known names.

- :attr:`Registry.items`: the registered objects, one list kept for the registry's life (callers may hold it);
- :attr:`Registry.table`: a live ``{name: object}`` mapping of them (``in``, ``[]``, iteration, ``.items()``);
- :meth:`Registry.register` (a class decorator too), :meth:`Registry.unregister`, :meth:`Registry.get`,
  :meth:`Registry.registered`, :meth:`Registry.names`.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Colour:
    ...     name: str
    >>> colours = Registry("a colour", "pages name it", instances=False)
    >>> _ = colours.register(Colour("red"))
    >>> colours.get("red"), "red" in colours.table, colours.names()
    (Colour(name='red'), True, ['red'])
    >>> colours.get("blue")
    Traceback (most recent call last):
    ...
    headlab.errors.ConfigError: no colour named 'blue'; registered: red
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, Generic, TypeVar

from headlab.errors import ConfigError

T = TypeVar("T")


def _name(obj: Any) -> str | None:
    return getattr(obj, "name", None)


class Registry(Generic[T]):
    """The named objects of one kind, in registration order.

    ``what``: how a message names one ("a report section"); ``why``: why it needs a name. ``instances``: register
    a class and keep one instance of it (a report section, an instrument), else keep what is registered (a
    class, a record). ``key(obj)``: its name, or a tuple of its names (default: ``obj.name``). ``taken(obj,
    names)`` and ``unknown(name, names)`` build the errors for a name already taken and a name not registered
    (defaults: a ``TypeError`` and a :class:`~headlab.errors.ConfigError`); ``strict``: unregistering a name not
    registered is that error too (else it does nothing).
    """

    def __init__(
        self,
        what: str,
        why: str = "",
        *,
        instances: bool = True,
        key: Callable[[Any], str | tuple[str, ...] | None] = _name,
        taken: Callable[[Any, list[str]], Exception] | None = None,
        unknown: Callable[[str, list[str]], Exception] | None = None,
        strict: bool = False,
    ) -> None:
        self.what, self.why, self.instances, self.key, self.strict = what, why, instances, key, strict
        self._taken, self._unknown = taken, unknown
        self.items: list[T] = []  # kept as one list object: callers may hold it
        self.table: MutableMapping[str, T] = _Table(self)

    # -- names ---------------------------------------------------------------------------------------------
    def keys_of(self, obj: Any) -> tuple[str, ...]:
        """The names ``obj`` answers to (none: it cannot be registered)."""
        k = self.key(obj)
        return () if not k else (k,) if isinstance(k, str) else tuple(k)

    def names(self) -> list[str]:
        """Every registered name, in registration order."""
        return [n for obj in self.items for n in self.keys_of(obj)]

    def find(self, name: str) -> T | None:
        """The object registered as ``name``, or None."""
        return next((obj for obj in self.items if name in self.keys_of(obj)), None)

    # -- errors --------------------------------------------------------------------------------------------
    def taken_error(self, obj: Any, names: list[str]) -> Exception:
        if self._taken is not None:
            return self._taken(obj, names)
        return TypeError(f"{self.what} named {names[0]!r} is already registered")

    def unknown_error(self, name: str) -> Exception:
        if self._unknown is not None:
            return self._unknown(name, self.names())
        return ConfigError(
            f"no {self.what.split(' ', 1)[-1]} named {name!r}; registered: {', '.join(self.names()) or 'none'}"
        )

    # -- registering ---------------------------------------------------------------------------------------
    def register(self, obj: T | type[T], *, replace: bool = False) -> Any:
        """Add ``obj`` (with ``instances``: one instance of the class ``obj``) and return ``obj``; usable as a class
        decorator. ``replace``: an object already holding one of its names gives way instead of being refused."""
        names = self.keys_of(obj)
        if not names:
            label = getattr(obj, "__name__", type(obj).__name__)
            raise TypeError(f"{label} has no name: {self.what} needs one" + (f" ({self.why})" if self.why else ""))
        clash = [n for n in names if self.find(n) is not None]
        if clash and not replace:
            raise self.taken_error(obj, clash)
        self._add(obj() if self.instances else obj, clash)  # type: ignore[operator, arg-type]  # instances: T is the class's instance type
        return obj

    def _add(self, item: T, clash: list[str]) -> None:
        for n in clash:
            self._drop(n)
        self.items.append(item)

    def unregister(self, name: str) -> T | None:
        """Remove the object registered as ``name`` (under all its names) and return it."""
        obj = self.find(name)
        if obj is None:
            if self.strict:
                raise self.unknown_error(name)
            return None
        self._drop(name)
        return obj

    def _drop(self, name: str) -> None:
        self.items[:] = [obj for obj in self.items if name not in self.keys_of(obj)]

    # -- reading -------------------------------------------------------------------------------------------
    def get(self, name: str) -> T:
        """The object registered as ``name``; an unknown name is the registry's typed error, naming the known ones."""
        obj = self.find(name)
        if obj is None:
            raise self.unknown_error(name)
        return obj

    def registered(self) -> list[T]:
        """The registered objects, in registration order (a copy)."""
        return list(self.items)

    def __repr__(self) -> str:
        return f"<headlab registry of {self.what.split(' ', 1)[-1]}s: {', '.join(self.names()) or 'none'}>"


class _Table(MutableMapping):
    """A registry read as ``{name: object}``, live: ``table[name] = obj`` registers ``obj`` in place of what held
    ``name``, ``del table[name]`` unregisters it; an unknown name is a ``KeyError`` (``in`` and ``.get`` work)."""

    def __init__(self, registry: Registry) -> None:
        self._r = registry

    def __getitem__(self, name: str):
        obj = self._r.find(name)
        if obj is None:
            raise KeyError(name)
        return obj

    def __setitem__(self, name: str, obj) -> None:
        names = self._r.keys_of(obj)
        if name not in names:
            raise TypeError(f"{self._r.what} answers to {list(names)}, not {name!r}")
        self._r._add(obj, [n for n in names if self._r.find(n) is not None])  # as it is: no instance made

    def __delitem__(self, name: str) -> None:
        if self._r.find(name) is None:
            raise KeyError(name)
        self._r.unregister(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._r.names())

    def __len__(self) -> int:
        return len(self._r.names())

    def __repr__(self) -> str:
        return repr(dict(self))


__all__ = ["Registry"]
