"""What the call-site oracle judged inside workloads: per backend and operation (a
workload such as ``workload:generate``), how many quantized-layer calls ran, how many
were judged against the float64 reference, how many failed, and the judged calls per
context signature (grad or not, inference mode, autocast, recomputation, rank, layout,
dtype: ``pytest_qconform.watch.context``). The report's answer to "in which settings
was this backend seen computing, and judged".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pytest_qconform.report.schema import SchemaError, json_object, required, string, type_name

CALLS_PROPERTY = "qconform_calls"  # a test's oracle summary, in its user_properties


def _count(data: dict, key: str, where: str) -> int:
    value = required(data, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(f"{where}.{key}: expected a non-negative integer, got {type_name(value)}")
    return value


@dataclass(frozen=True)
class CallCoverage:
    """The calls of one backend's quantized layers judged in one operation's workloads."""

    backend: str
    operation: str
    seen: int
    judged: int
    failed: int
    contexts: dict[str, int]  # context signature -> judged calls

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "operation": self.operation,
            "seen": self.seen,
            "judged": self.judged,
            "failed": self.failed,
            "contexts": dict(sorted(self.contexts.items())),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "calls") -> CallCoverage:
        data = json_object(data, where)
        contexts = json_object(required(data, "contexts", where), f"{where}.contexts")
        for signature, count in contexts.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise SchemaError(f"{where}.contexts[{signature!r}]: expected a non-negative integer")
        return cls(
            string(data, "backend", where, nonempty=True),
            string(data, "operation", where, nonempty=True),
            _count(data, "seen", where),
            _count(data, "judged", where),
            _count(data, "failed", where),
            dict(contexts),
        )


def merged(entries: Iterable[tuple[str, dict[str, Any]]]) -> tuple[CallCoverage, ...]:
    """One ``CallCoverage`` per (backend, operation) from each test's ``(operation,
    oracle summary)``, summed; in (backend, operation) order."""
    totals: dict[tuple[str, str], dict[str, Any]] = {}
    for operation, summary in entries:
        for backend, found in summary.items():
            entry = totals.setdefault((backend, operation), {"seen": 0, "judged": 0, "failed": 0, "contexts": {}})
            for key in ("seen", "judged", "failed"):
                entry[key] += int(found[key])
            for signature, count in found["contexts"].items():
                entry["contexts"][signature] = entry["contexts"].get(signature, 0) + int(count)
    return tuple(
        CallCoverage(backend, operation, e["seen"], e["judged"], e["failed"], e["contexts"])
        for (backend, operation), e in sorted(totals.items())
    )
