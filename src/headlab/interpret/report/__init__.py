"""The ``analyze`` job (:mod:`.analyze_job`), its sections (:mod:`.sections`), its figures (:mod:`.figures`) and its HTML page (:mod:`.html`)."""

from headlab.interpret.report.analyze_job import MAX_FULL_TOKENS, ReportResult, analyze

# isort: split
from headlab.interpret.report import instrument  # noqa: F401  (last: registers the analyze instrument)

__all__ = ["MAX_FULL_TOKENS", "ReportResult", "analyze"]
