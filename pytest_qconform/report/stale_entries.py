"""Known-failure entries that matched no collected test in a run: stale, or mistyped.

An entry whose backend, version and arch this run has, but which marks no test, says
nothing any more: its test was renamed, its check or format glob no longer matches, or
the failure moved. array-api-tests warns about such expectations; the run's summary says
so (``session/stale_known_failures.py``) and the report keeps them, so that the matrix
lists them beside the known failures they were meant to be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pytest_qconform.report.schema import json_object, string


@dataclass(frozen=True)
class StaleEntry:
    """One known-failures entry that marked no collected test, and where it is written."""

    source: str  # "file:line" of the entry
    backend: str
    check: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "backend": self.backend, "check": self.check, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Any, where: str = "stale_known_failures") -> StaleEntry:
        data = json_object(data, where)
        return cls(
            string(data, "source", where, nonempty=True),
            string(data, "backend", where, nonempty=True),
            string(data, "check", where, nonempty=True),
            string(data, "reason", where),
        )

    def line(self) -> str:
        """``pytest_qconform/session/known_failures.toml:173 (bitsandbytes checkpoint)``."""
        return f"{self.source} ({self.backend} {self.check})"
