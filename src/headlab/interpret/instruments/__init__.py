"""Instruments: one registered class per analysis, run by one study runner.

The contract is :mod:`~headlab.interpret.instruments.base` (:class:`Instrument`, :class:`Option`,
:class:`Output`, the registry), the lifecycle :mod:`~headlab.interpret.instruments.runner`. Adding an
instrument is one file here (a subclass under ``@register``) plus its import line below; ``headlab.cli.rows``
turns it into a command. Two register from their own rooms, above this one: ``analyze`` from
:mod:`headlab.interpret.report.instrument` (the report sits at the top of ``interpret``) and ``generate`` /
``train-gates`` from :mod:`headlab.decode.instrument`. See docs/instruments.md.
"""

from headlab.interpret.instruments.base import (REQUIRED, Context, Instrument, InstrumentResult, Option, Outcome,
                                                Output, Part, Registry, Unit, at_least, get, register, registered,
                                                unregister)

# each import registers its instrument
from headlab.interpret.instruments import flow  # noqa: E402,F401  (rollout, flow, value-aware norms)
from headlab.interpret.instruments import probe  # noqa: E402,F401  (heads against dependency relations)
from headlab.interpret.instruments import heads  # noqa: E402,F401  (head importance and ablation)
from headlab.interpret.instruments import atlas  # noqa: E402,F401  (every head's roles, checked causally)
from headlab.interpret.instruments import patch  # noqa: E402,F401  (activation and attribution patching)
from headlab.interpret.instruments import explain  # noqa: E402,F401  (attention against saliency; the corpus study)
from headlab.interpret.instruments import prune  # noqa: E402,F401  (physical head pruning)
from headlab.interpret.instruments import pattern  # noqa: E402,F401  (sparse attention patterns, no model)
from headlab.interpret.instruments import circuit  # noqa: E402,F401  (edge scores, circuit discovery, faithfulness)

__all__ = ["Context", "Instrument", "InstrumentResult", "Option", "Outcome", "Output", "Part", "REQUIRED", "Registry",
           "Unit", "at_least", "get", "register", "registered", "unregister"]
