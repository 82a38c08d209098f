"""The atlas's kinds: one module each, registered in page order (see :mod:`.base` for the record).

``from headlab.interpret.atlas.kinds import KINDS, ROLE``: ``KINDS`` the registry ``{name: Kind}``,
``ROLE`` its view ``{name: role}``; :func:`register` adds a kind (at the end of the page), :func:`unregister`
removes one.
"""

from headlab.interpret.atlas.kinds.base import KINDS, ROLE, Kind, Measure, Run, Task, register, unregister

# isort: off
from headlab.interpret.atlas.kinds import previous_token, duplicate_token, induction  # noqa: F401  (page order)
from headlab.interpret.atlas.kinds import retrieval, sink, local, syntactic  # noqa: F401  (page order)
# isort: on

__all__ = ["KINDS", "ROLE", "Kind", "Measure", "Run", "Task", "register", "unregister"]
