"""The numbers a KV rule holds, checked where the rule is made: KIVI's precision (``bits``, ``group``,
``residual``), a window's ``sink`` and ``recent``, and the counts of the SnapKV rules; and what a policy file
holds (:func:`check_policy_data`, for ``Policy.load``, ``--kv-from`` and ``--kv-policy``).

A rule is refused when it is built, by its function (``kv.full(bits=3)``) or its class (``kv.Full(bits=3)``)
alike, so that no rule a decode cannot run reaches the cache::

    >>> check_stored(3, 32, 128)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    headlab.errors.ConfigError: bits=3: a kv head stores keys and values at 16 (the cache's dtype), 8, 4 or 2 bits ...
"""

from __future__ import annotations

from collections.abc import Mapping

import headlab.checks as checks
from headlab.errors import ConfigError, InputError

__all__ = [
    "BITS",
    "GROUP",
    "POLICY_FORMAT",
    "RESIDUAL",
    "RULE_COUNT",
    "check_count",
    "check_policy_data",
    "check_precision",
    "check_stored",
    "check_window",
]

BITS = (16, 8, 4, 2)  # 16: the cache's own dtype; 8, 4, 2: quantized (KIVI)
GROUP = 32  # numbers per scale: tokens per key group (per channel), channels per value group (per token)
RESIDUAL = 128  # the most recent tokens kept in full precision (a multiple of the group; 0: none past a group)

RULE_COUNT = "{name}={value!r} must be at least {low} (a whole number)"  # how a rule refuses a count
POLICY_FORMAT = '{"default": ..., "heads": {"layer.kv_head": rule}}'  # what a policy file holds (Policy.save)
# the result files a user may mistake for a policy, by the kind in their header
_NOT_POLICIES = {
    "analyze": "the per-head table headlab analyze and headlab demo write as heads.json",
    "head_atlas": "an atlas: give it to --kv-from with --keep, or to Policy.from_atlas",
    "kv_gates": "trained gates: give them to --kv-from with --keep, or to Policy.from_gates",
}
_BITS = (
    "bits={value!r}: a kv head stores keys and values at 16 (the cache's dtype), 8, 4 or 2 bits (KIVI's "
    "asymmetric min-max groups)"
)


def check_count(name: str, value, *, low: int) -> int:
    """A rule's count (a budget, a window, a group): an integer ``>= low``."""
    return checks.int_at_least(name, value, low, message=RULE_COUNT)


def check_stored(bits, group, residual) -> tuple[int, int, int]:
    """What a full or windowed rule stores: ``bits`` one of :data:`BITS` (an int: 4.0 is refused), and for a
    quantized rule a ``group`` of at least 1 and a ``residual`` of at least 0, a multiple of the group (0: nothing
    waits in full precision but the keys of a group not yet whole)."""
    bits = checks.one_of("bits", checks.integer("bits", bits, message=_BITS), BITS, message=_BITS)
    if bits != 16:
        check_count("group", group, low=1)
        check_count("residual", residual, low=0)
        if residual % group:
            raise ConfigError(
                f"residual={residual} must be a multiple of group={group}: the keys leave the "
                "full-precision residual a group of tokens at a time (KIVI), e.g. group=32, "
                "residual=128"
            )
    return bits, group, residual


def check_precision(bits, group, residual) -> tuple[int, int, int]:
    """``(bits, group, residual)`` as a rule function takes them: ``group``/``residual`` None take the defaults,
    and are refused with ``bits=16`` (which stores every key as it is)."""
    if checks.is_int(bits) and bits == 16:
        if group is not None or residual is not None:
            raise ConfigError(
                "group and residual set how a quantized head stores its keys; give them with bits=8, 4 "
                "or 2 (bits=16 stores every key as it is)"
            )
        return 16, GROUP, RESIDUAL
    return check_stored(bits, GROUP if group is None else group, RESIDUAL if residual is None else residual)


def check_window(sink, recent, compensate) -> None:
    """A window's counts of keys (each >= 0, not both 0) and its ``compensate`` flag."""
    for name, val in (("sink", sink), ("recent", recent)):
        checks.integer(f"window {name}", val)
        checks.non_negative_int(
            name,
            val,
            message="window {name}={value} is negative; give a count of keys >= 0, e.g. window(sink=4, recent=256)",
        )
    if sink + recent == 0:
        raise ConfigError(
            "window(sink=0, recent=0) keeps no key, so its heads would see nothing; keep at least one "
            "key (e.g. window(sink=4, recent=256)), or use kv.drop to prune the head"
        )
    checks.boolean("compensate", compensate)


def _json_what(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)} item{'s' if len(value) != 1 else ''}"
    return f"{type(value).__name__} {value!r}"[:80]


def check_policy_data(data, source: str) -> Mapping:
    """A policy file's content, once checked (``source`` names it in messages: ``"policy file 'p.json'"``): an
    object whose ``"heads"`` maps ``"layer.kv_head"`` to rules; returns that mapping. A result of another kind
    (the ``heads.json`` of ``headlab analyze``, an atlas) is an :class:`~headlab.errors.InputError` naming it."""
    head = data.get("headlab") if isinstance(data, dict) else None
    kind = head.get("kind") if isinstance(head, dict) else None
    if kind is not None and kind != "kv_policy":
        what = _NOT_POLICIES.get(kind, "a headlab result of another kind")
        raise InputError(
            f"{source}: expected a KV policy, {POLICY_FORMAT} (as Policy.save writes it); it holds a "
            f"result of kind {kind!r}, {what}"
        )
    if not isinstance(data, dict) or "heads" not in data:
        raise InputError(f"{source}: expected {POLICY_FORMAT}")
    heads = data["heads"]
    if not isinstance(heads, Mapping):
        raise InputError(
            f'{source}: "heads" must be an object {{"layer.kv_head": rule}}, got {_json_what(heads)}; '
            f"a policy file holds {POLICY_FORMAT}, as Policy.save writes it"
        )
    return heads
