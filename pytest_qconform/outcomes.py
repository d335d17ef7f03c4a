"""Turn pytest's per-test reports into matrix cases (one per test item).

Tests carry their cell key (backend, operation, format, dtype, target) in
``user_properties`` from collection on, so this works identically under pytest-xdist,
where the controller sees only serialized reports.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

KEY_PROPERTY = "qconform_key"
MULTIPLE_PROPERTY = "qconform_multiple"
REPRO_PROPERTY = "qconform_repro"
UNAVAILABLE_PREFIX = "unavailable:"
NOT_CLAIMED_PREFIX = "not claimed:"
OOM_PREFIX = "out of memory:"

# Worse verdicts override milder ones when an item reports several phases.
_SEVERITY = {"crashed": 7, "timeout": 6, "fail": 5, "known-failure": 4, "pass": 3, "skipped": 2, "unavailable": 1}


@dataclass(frozen=True)
class Case:
    """The outcome of one test item, keyed by its matrix cell."""

    nodeid: str
    backend: str
    operation: str
    format: str
    dtype: str
    target: str
    verdict: str
    worst_error_multiple: float | None
    message: str
    repro: str

    @property
    def cell_key(self) -> tuple[str, str, str, str]:
        return (self.backend, self.operation, self.format, self.dtype)


def _props(report: pytest.TestReport) -> dict[str, Any]:
    props: dict[str, Any] = {}
    multiples: list[float] = []
    for name, value in report.user_properties:
        if name == MULTIPLE_PROPERTY:
            multiples.append(float(value))
        else:
            props[name] = value
    props[MULTIPLE_PROPERTY] = max(multiples) if multiples else None
    return props


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
        return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
    return str(longrepr or "")


def _failure_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    return str(report.longrepr or "failed").strip().splitlines()[-1] if report.longrepr else "failed"


def verdict_of(report: pytest.TestReport) -> tuple[str, str] | None:
    """(verdict, message) of one phase's report, or None when the phase says nothing."""
    if hasattr(report, "wasxfail"):
        if report.skipped:
            return "known-failure", str(report.wasxfail)
        return "fail", f"known failure passed unexpectedly (fixed upstream?): {report.wasxfail}"
    if report.failed:
        message = _failure_message(report)
        if report.when != "call" and "Timeout" in message:
            return "timeout", message
        if "Timeout" in message and "pytest-timeout" in str(report.longrepr):
            return "timeout", message
        return "fail", message
    if report.skipped:
        reason = _skip_reason(report)
        if reason.startswith(NOT_CLAIMED_PREFIX):
            return None
        if reason.startswith(UNAVAILABLE_PREFIX):
            return "unavailable", reason
        return "skipped", reason
    if report.when == "call" and report.passed:
        return "pass", ""
    return None


def case_from_report(report: pytest.TestReport) -> Case | None:
    """A case for one phase's report of a qconform-keyed item, else None."""
    props = _props(report)
    key = props.get(KEY_PROPERTY)
    if not key:
        return None
    found = verdict_of(report)
    if found is None:
        return None
    verdict, message = found
    return Case(report.nodeid, key["backend"], key["operation"], key["format"], key["dtype"], key["target"],
                verdict, props.get(MULTIPLE_PROPERTY), message, str(props.get(REPRO_PROPERTY, "")))


def worse(a: Case | None, b: Case) -> Case:
    """The case to keep when one item reports two phases (setup and call, call and teardown)."""
    if a is None or _SEVERITY[b.verdict] >= _SEVERITY[a.verdict]:
        return b
    return a
