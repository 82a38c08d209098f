"""Instruments: one registered class per analysis, run by one study runner.

The contract is :mod:`~headlab.interpret.instruments.base` (:class:`Instrument`, :class:`Option`,
:class:`Output`, the registry), the lifecycle :mod:`~headlab.interpret.instruments.runner`. Adding an
instrument is one file here (a subclass under ``@register``) plus its import line below; ``headlab.cli.rows``
turns it into a command. See docs/instruments.md.
"""

from headlab.interpret.instruments.base import (REQUIRED, Context, Instrument, InstrumentResult, Option, Outcome,
                                                Output, Part, Registry, Unit, at_least, get, register, registered,
                                                unregister)

# each import registers its instrument
from headlab.interpret.instruments import flow  # noqa: E402,F401  (rollout, flow, value-aware norms)
from headlab.interpret.instruments import probe  # noqa: E402,F401  (heads against dependency relations)
from headlab.interpret.instruments import heads  # noqa: E402,F401  (head importance and ablation)

__all__ = ["Context", "Instrument", "InstrumentResult", "Option", "Outcome", "Output", "Part", "REQUIRED", "Registry",
           "Unit", "at_least", "get", "register", "registered", "unregister"]
