"""Instruments: one registered class per analysis, run by one study runner.

The contract is :mod:`~headlab.interpret.study.base` (:class:`Instrument`, :class:`Option`,
:class:`Output`, the registry), the lifecycle :mod:`~headlab.interpret.study.runner`, both re-exported here. Adding an
instrument is one file here (a subclass under ``@register``): this package imports every module in it, and the
command table (:mod:`headlab.cli.table`) makes it a command. Two register from their own rooms, above this one: ``analyze`` from
:mod:`headlab.interpret.report.instrument` (the report sits at the top of ``interpret``) and ``generate`` /
``train-gates`` from :mod:`headlab.decode.instrument`. See docs/instruments.md.
"""

import pkgutil as _pkgutil
from importlib import import_module as _import_module

from headlab.interpret.study import runner
from headlab.interpret.study.base import (
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

# every module of this package is imported, which registers its instruments (atlas_sizes, the atlas's checks, holds
# none): a new instrument is one file here; the command table, headlab.cli.table, reads the same files for its rows
for _m in _pkgutil.iter_modules(__path__):
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
    "runner",
    "unregister",
]
