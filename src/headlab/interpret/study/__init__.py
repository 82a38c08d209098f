"""The study runner and the contract of its instruments, below every room of ``interpret`` that computes.

:mod:`~headlab.interpret.study.base` is the contract (:class:`~headlab.interpret.study.base.Instrument`,
``Option``, ``Output``, ``Unit``, the registry), :mod:`~headlab.interpret.study.runner` the one lifecycle (check,
read, load, units, recording, Ctrl-C, finish, write) and :mod:`~headlab.interpret.study.checkpoint` the units a
result file keeps for ``--resume``. The rooms' named functions (:func:`headlab.head_importance`, ...) run their
instrument through :func:`~headlab.interpret.study.runner.call`; the instruments themselves live above the rooms
(:mod:`headlab.interpret.instruments`, and the report's and decode's own), and the runner finds them by name in
the registry.
"""
