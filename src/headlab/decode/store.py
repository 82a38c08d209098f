"""What holds a layer's kv heads in a :class:`~headlab.decode.cache.HeadCache` (:class:`KVStore`), and the registry of
stores (:data:`STORES`, :func:`register_store`), in the manner of transformers' ``CacheLayerMixin``.

A cache layer splits its kv heads into groups that share a rule, and each group is held by the store its rule names
(``rule.store``, a name in :data:`STORES`). The built-in stores are in :mod:`headlab.decode.groups` (``"none"``,
``"plain"``), :mod:`headlab.decode.quant_store` (``"quant"``) and :mod:`headlab.decode.snap_group` (``"snap"``). A new store is one subclass of
:class:`KVStore` with a ``name``, decorated with :func:`register_store`; a rule whose ``store`` is that name is then
held by it (``tests/test_kv_store_registry.py`` adds one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from headlab.decode.rules import Rule
from headlab.errors import ConfigError
from headlab.registry import Registry

SPARSE_PREFILL = 128  # below this many queries a window's tiles are too few for the sparse kernel to pay


def own(t: torch.Tensor) -> torch.Tensor:
    """``t`` in memory of its own: a slice of a larger tensor would keep all of it alive, uncounted by ``nbytes``."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)


class KVStore:
    """The kv heads ``kv_heads`` of a layer (of ``n_kv``, each read by ``rep`` query heads) that share ``rule``.

    A store implements:

    - ``name``: the name a rule's ``store`` gives (``"plain"``), its key in :data:`STORES`;
    - :meth:`reset`: forget everything held (also called once by ``__init__``, to set the store up);
    - :meth:`append`: take its heads' new keys and values ``(B, heads of store, m, d)`` at positions ``new_pos``;
    - :meth:`attend`: the output of its query heads ``q (B, heads of store, m, d)`` at positions ``q_pos`` on what
      it holds, evicting what the rule lets go;
    - :meth:`nbytes`: the bytes it holds (what :meth:`~headlab.decode.cache.HeadCache.nbytes` adds up), and
      ``v_dim``: the width of its values (None while it holds none);
    - :meth:`positions`: the positions of the keys each of its kv heads holds (default: none).

    :meth:`take` and :meth:`read` pick its heads out of the layer's and call :meth:`append` and :meth:`attend`; a
    store that holds nothing (``"none"``) overrides them instead. The store asks its rule what to show and keep
    (``visible``, ``retain``, ``ring``, ``sinks``, ``prefill``), never its kind.
    """

    name: ClassVar[str] = ""
    v_dim: int | None = None
    storage: torch.dtype | None = None  # set by HeadCache(dtype=...): the dtype its keys and values are held in

    def __init__(self, rule: Rule, kv_heads: list[int], rep: int, n_kv: int):
        self.rule, self.rep = rule, rep
        self.whole = len(kv_heads) == n_kv  # the layer's only store: no gathering of heads
        # the store's kv heads and query heads (query head h reads kv head h // rep), in the order of its kv heads:
        # integers, so that every tensor a store holds is what it caches (nbytes); kv and q give them as tensors
        self.kv_heads = tuple(kv_heads)
        self.q_heads = tuple(j * rep + r for j in kv_heads for r in range(rep))
        self.reset()

    @property
    def kv(self) -> torch.Tensor:
        """The store's kv heads, ``(heads of store,)`` long."""
        return torch.tensor(self.kv_heads, dtype=torch.long)

    @property
    def q(self) -> torch.Tensor:
        """The store's query heads, ``(query heads of store,)`` long, in the order of its kv heads."""
        return torch.tensor(self.q_heads, dtype=torch.long)

    def reset(self) -> None:  # pragma: no cover - every store has one
        raise NotImplementedError

    def append(self, k: torch.Tensor, v: torch.Tensor, new_pos: torch.Tensor) -> None:  # pragma: no cover
        raise NotImplementedError

    def attend(
        self, attention, q: torch.Tensor, q_pos: torch.Tensor, hf, scaling, softcap, *, fresh: bool
    ) -> torch.Tensor:  # pragma: no cover
        """``attention``: :func:`headlab.attention`'s signature; ``hf``: the model's boolean mask or None; ``scaling``,
        ``softcap``: the model's; ``fresh``: a prefill into an empty cache (the rule's own prefill may run)."""
        raise NotImplementedError

    def nbytes(self) -> int:  # pragma: no cover
        raise NotImplementedError

    def take(self, k: torch.Tensor, v: torch.Tensor, new_pos: torch.Tensor) -> None:
        """Store this store's heads of the layer's new keys and values ``(B, Hkv, m, d)`` at ``new_pos`` (in the
        ``storage`` dtype when one is set)."""
        if self.storage is not None and k.dtype != self.storage:
            k, v = k.to(self.storage), v.to(self.storage)
        if self.whole:
            self.append(k, v, new_pos)
        else:
            self.append(k.index_select(1, self.kv.to(k.device)), v.index_select(1, self.kv.to(v.device)), new_pos)

    def read(
        self, attention, query: torch.Tensor, q_pos: torch.Tensor, hf, scaling, softcap, *, fresh: bool
    ) -> torch.Tensor | None:
        """The output ``(B, heads of store, m, dv)`` of this store's query heads of ``query (B, H, m, d)``."""
        q = query if self.whole else query.index_select(1, self.q.to(query.device))  # (B, heads of store, m, d)
        return self.attend(attention, q, q_pos, hf, scaling, softcap, fresh=fresh)

    def positions(self) -> list[torch.Tensor]:
        """The positions of the keys each kv head holds."""
        return [torch.zeros(0, dtype=torch.long)] * len(self.kv)


def _taken(cls: type[KVStore], names: list[str]) -> ConfigError:
    return ConfigError(
        f"a kv store named {names[0]!r} is already registered ({STORES[names[0]].__name__}); "
        f"unregister_store({names[0]!r}) first"
    )


def _unknown(name: str, names: list[str]) -> ConfigError:
    return ConfigError(f"no kv store {name!r} is registered; the stores: {', '.join(names)}")


_STORES: Registry[type[KVStore]] = Registry(
    "a kv store", "a rule's store names it", instances=False, strict=True, taken=_taken, unknown=_unknown
)
STORES: Mapping[str, type[KVStore]] = _STORES.table  # a store's name -> its class (what rule.store names), live


def register_store(cls: type[KVStore]) -> type[KVStore]:
    """Class decorator: add a store under its ``name`` (a rule whose ``store`` is that name is then held by it).
    Refuses a class that is not a complete :class:`KVStore`, or a name taken."""
    if not (isinstance(cls, type) and issubclass(cls, KVStore)):
        raise ConfigError(f"register_store takes a subclass of headlab.decode.store.KVStore, got {cls!r}")
    own = set().union(*(vars(c) for c in cls.__mro__[: cls.__mro__.index(KVStore)]))
    need = ["reset", "nbytes"] + (["append", "attend"] if not {"take", "read"} <= own else [])
    missing = [m for m in need if m not in own]
    if missing:
        raise ConfigError(
            f"kv store {cls.__name__} does not define {', '.join(missing)}: a store takes its heads' "
            "keys, attends with their queries, counts its bytes and forgets (see KVStore)"
        )
    if not isinstance(cls.name, str) or not cls.name:
        raise ConfigError(f"kv store {cls.__name__} has no name: set name = '...', the name a rule's store gives")
    return _STORES.register(cls)


def unregister_store(name: str) -> type[KVStore]:
    """Remove the store registered as ``name`` and return its class."""
    cls = _STORES.unregister(name)
    assert cls is not None  # a strict registry raises for an unknown name
    return cls


def store_for(rule: Rule) -> type[KVStore]:
    """The store class that holds ``rule``'s heads (its ``rule.store``)."""
    if rule.store not in STORES:
        raise ConfigError(
            f"{rule!r} is held by the store {rule.store!r}, which is not one of the cache's stores "
            f"({', '.join(STORES)}); register it with headlab.decode.store.register_store"
        )
    return STORES[rule.store]


__all__ = ["KVStore", "SPARSE_PREFILL", "STORES", "own", "register_store", "store_for", "unregister_store"]
