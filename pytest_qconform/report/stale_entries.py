"""Known-failure entries that matched no collected test in a run: stale, or mistyped.

An entry whose backend, version and arch this run has, but which marks no test, says
nothing any more: its test was renamed, its check or format glob no longer matches, or
the failure moved. array-api-tests warns about such expectations; the run's summary says
so (``session/stale_known_failures.py``) and the report keeps them, so that the matrix
lists them beside the known failures they were meant to be.
"""

from __future__ import annotations

from pydantic.dataclasses import dataclass

from pytest_qconform.report.records import RECORD_CONFIG, EveryKeyWritten, Name, Text


@dataclass(frozen=True, config=RECORD_CONFIG)
class StaleEntry(EveryKeyWritten):
    """A known-failures entry that could have matched the run and marked no collected test."""

    source: Name  # "file:line" of the entry
    backend: Name
    check: Name
    reason: Text

    def line(self) -> str:
        """``pytest_qconform/session/known_failures.toml:173 (bitsandbytes checkpoint)``."""
        return f"{self.source} ({self.backend} {self.check})"
