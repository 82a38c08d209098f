"""Instruments: one registered class per analysis, run by one study runner.

The contract is :mod:`~headlab.interpret.instruments.base` (:class:`Instrument`, :class:`Option`,
:class:`Output`, the registry), the lifecycle :mod:`~headlab.interpret.instruments.runner`. Adding an
instrument is one file here (a subclass under ``@register``): this package imports every module in it, and the
command table (:mod:`headlab.cli.table`) makes it a command. Two register from their own rooms, above this one: ``analyze`` from
:mod:`headlab.interpret.report.instrument` (the report sits at the top of ``interpret``) and ``generate`` /
``train-gates`` from :mod:`headlab.decode.instrument`. See docs/instruments.md.
"""

import pkgutil as _pkgutil
from importlib import import_module as _import_module

from headlab.interpret.instruments.base import (
    REQUIRED,
    Context,
    Instrument,
    InstrumentResult,
    Option,
    Outcome,
    Output,
    Part,
    Registry,
    Unit,
    at_least,
    get,
    register,
    registered,
    unregister,
)

# every module of this package but the contract and the runner is an instrument: importing it registers it (a new
# instrument is one file here; the command table, headlab.cli.table, reads the same files for the CLI's rows)
for _m in _pkgutil.iter_modules(__path__):
    if _m.name not in ("base", "runner"):
        _import_module(f"{__name__}.{_m.name}")

__all__ = [
    "Context",
    "Instrument",
    "InstrumentResult",
    "Option",
    "Outcome",
    "Output",
    "Part",
    "REQUIRED",
    "Registry",
    "Unit",
    "at_least",
    "get",
    "register",
    "registered",
    "unregister",
]
