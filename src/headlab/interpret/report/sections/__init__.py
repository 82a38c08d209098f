"""The sections of ``headlab analyze``'s report, in page order.

A section is one file here: a :class:`~headlab.interpret.report.sections.base.Section` subclass that
names the capture sites it needs, computes a result object from the one recording, writes its files
and gives its part of the page. Adding one to the report is that file plus its line below.
"""

from headlab.interpret.report.sections.base import Job, PagePart, Section, register, registered

# registration (import) order is page order; a later section may read the results of earlier ones
# isort: off
from headlab.interpret.report.sections import heads  # noqa: F401  (the table and the maps)
from headlab.interpret.report.sections import saliency  # noqa: F401  (the saliency strip)
from headlab.interpret.report.sections import flow  # noqa: F401  (norm maps and rollout)
from headlab.interpret.report.sections import atlas  # noqa: F401  (each head's roles from the head atlas)
# isort: on

__all__ = ["Job", "PagePart", "Section", "register", "registered"]
