"""The ``analyze`` job (:mod:`.job`), its figures (:mod:`.figures`) and its HTML page (:mod:`.html`)."""

from headlab.interpret.report.job import MAX_FULL_TOKENS, ReportResult, analyze

__all__ = ["MAX_FULL_TOKENS", "ReportResult", "analyze"]
