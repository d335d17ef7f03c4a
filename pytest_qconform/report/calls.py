"""What the call-site oracle judged inside workloads: per backend and operation (a
workload such as ``workload:generate``), how many quantized-layer calls ran, how many
were judged against the float64 reference, how many failed, and the judged calls per
context signature (grad or not, inference mode, autocast, recomputation, rank, layout,
dtype: ``pytest_qconform.watch.context``). The report's answer to "in which settings
was this backend seen computing, and judged".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic.dataclasses import dataclass

from pytest_qconform.report.records import RECORD_CONFIG, Count, EveryKeyWritten, Name

CALLS_PROPERTY = "qconform_calls"  # a test's oracle summary, in its user_properties


@dataclass(frozen=True, config=RECORD_CONFIG)
class CallCoverage(EveryKeyWritten):
    """What the call-site oracle judged inside workloads, for one backend and operation."""

    backend: Name
    operation: Name
    seen: Count  # calls of the backend's quantized layers made while watched
    judged: Count  # of those, the calls judged against the float64 reference
    failed: Count  # judged calls outside their bound or their contract
    contexts: dict[str, Count]  # context signature -> judged calls


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
