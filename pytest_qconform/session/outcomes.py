"""Turn pytest's per-test reports into matrix cases (one per test item).

Tests carry their ``CaseKey`` (backend, operation, format, dtype, target) in
``user_properties`` from collection on, so this works identically under pytest-xdist,
where the controller sees only serialized reports. ``attach_key`` writes it there and
``case_key_of`` reads it back: no other module touches its wire form.

Two outcomes come from outside the test: a worker process that died (pytest-xdist
reports "worker 'gw0' crashed while running '<nodeid>'" with no properties) and a test
stopped by pytest-timeout (in-process with ``--timeout-method=signal``: a failure
"Timeout (>Ns) from pytest-timeout."; with ``--timeout-method=thread`` the worker is
killed, which xdist reports as a crash). ``crash_case`` turns the former into
``crashed`` or ``timeout`` from what the recorder remembered of the test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, cast

import pytest

from pytest_qconform.vocabulary import (
    FAILING,
    NOT_CLAIMED_PREFIX,
    NOTHING_CLAIMED_PREFIX,
    OTHER_DEVICE_PREFIX,
    UNAVAILABLE_PREFIX,
    CaseKey,
    Verdict,
)
from pytest_qconform.vocabulary import OOM_PREFIX as OOM_PREFIX  # public API here too, as the others (__init__.py)

if TYPE_CHECKING:  # the report's records import pydantic: only a --qconform run builds them
    from pytest_qconform.report.cells import Cell

KEY_PROPERTY = "qconform_key"
MULTIPLE_PROPERTY = "qconform_multiple"
REPRO_PROPERTY = "qconform_repro"
AXES_PROPERTY = "qconform_axes"  # the axis values of an instance of a check with declared axes
CLAIMED_AXES_PROPERTY = "qconform_claimed_axes"  # the values its backend claims on each of those axes
VERDICT_PROPERTY = "qconform_verdict"  # the verdict the session decided for a skip or failure it raised (declare)
NO_CELL = "no-cell"  # declared for a skip that makes no cell (the backend claims nothing of the instance)
TIMEOUT_MESSAGE = "from pytest-timeout"  # pytest-timeout's signal-method failure message ends so
XPASS_STRICT_PREFIX = "[XPASS(strict)]"  # pytest's longrepr of a strict xfail that passed
WORKER_CRASH_MARK = "crashed while running"  # pytest-xdist's report of a dead worker
DEVICE_LOST_PREFIX = "device lost:"  # a test after which its device is unusable (device_loss.py)
# The verdicts that end a backend's later tests at once (short_circuit.py, device_loss.py), and
# the word a short-circuited test's message says its cause was.
SHORT_CIRCUIT_CAUSES: dict[Verdict, str] = {Verdict.CRASHED: "crash", Verdict.TIMEOUT: "timeout"}


@dataclass(frozen=True)
class Case:
    """The outcome of one test item: where it ran, the report's cell of this one case (which
    the recorder folds with the other cases of its key, unchanged), and the axis values it
    covered. One record from the test to the report: the cell is not copied field by field."""

    nodeid: str
    target: str
    cell: Cell
    axes: tuple[tuple[str, str], ...] = ()  # (axis, value label) of a check with declared axes
    claimed: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (axis, the labels claimed on it)

    @property
    def backend(self) -> str:
        return self.cell.backend

    @property
    def operation(self) -> str:
        return self.cell.operation

    @property
    def verdict(self) -> Verdict:
        return self.cell.verdict

    @property
    def message(self) -> str:
        """Why: the failure's message, or the reason of any other verdict."""
        return self.cell.first_failure["message"] if self.cell.first_failure else self.cell.reason


def one_case_cell(key: CaseKey, verdict: Verdict, multiple: float | None, message: str, repro: str) -> Cell:
    """The cell of one test case: a failing verdict carries its message and repro as the
    first failure, any other its message as the reason."""
    from pytest_qconform.report.cells import Cell, FirstFailure

    failed = verdict in FAILING
    return Cell(
        *key.cell,
        verdict,
        cases=1,
        worst_error_multiple=multiple,
        first_failure=FirstFailure(message=message, repro=repro) if failed else None,
        reason="" if failed else message,
    )


def attach_key(item: pytest.Item, key: CaseKey) -> None:
    """Attach ``key`` to ``item`` at collection, in the wire form its reports carry."""
    item.user_properties.append((KEY_PROPERTY, key.wire()))


def case_key_of(carrier: pytest.Item | pytest.TestReport) -> CaseKey | None:
    """The key the plugin attached to a test item at collection, read from the item or from
    any of its reports, or None for a test outside the conformance cells."""
    return CaseKey.from_wire(dict(carrier.user_properties).get(KEY_PROPERTY))


def _props(report: pytest.TestReport) -> dict[str, Any]:
    props: dict[str, Any] = {}
    multiples: list[float] = []
    for name, value in report.user_properties:
        if name == MULTIPLE_PROPERTY:
            multiples.append(float(cast(float, value)))
        else:
            props[name] = value
    props[MULTIPLE_PROPERTY] = max(multiples) if multiples else None
    return props


def skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
        return reason[len("Skipped: ") :] if reason.startswith("Skipped: ") else reason
    return str(longrepr or "")


def _failure_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    return str(report.longrepr or "failed").strip().splitlines()[-1] if report.longrepr else "failed"


def short_circuit(item: pytest.Item, verdict: Verdict, nodeid: str, rest: str) -> NoReturn:
    """End ``item`` at once with ``verdict`` (crashed or timeout), not run, after the same
    verdict in ``nodeid`` (``timeout after an earlier timeout in <nodeid>: <rest>``), declared
    as a value."""
    __tracebackhide__ = True
    declare(item.user_properties, verdict)
    pytest.fail(f"{verdict} after an earlier {SHORT_CIRCUIT_CAUSES[verdict]} in {nodeid}: {rest}", pytrace=False)


def _unexpected_pass(reason: str) -> str:
    return (
        f"passed unexpectedly: this test is listed as a known failure ({reason}); "
        "if it is fixed, remove or narrow that known-failures entry"
    )


def declare(properties: list[tuple[str, object]], verdict: Verdict | None) -> None:
    """Say what the skip or failure the session raises next means (None: no cell), as a value
    that travels with the test's reports (``user_properties``: pytest-xdist sends them to the
    controller), so that the recorder reads it instead of parsing the message. ``properties``:
    the item's (before a skip or failure it raises) or the report's (in ``pytest_runtest_makereport``)."""
    properties.append((VERDICT_PROPERTY, NO_CELL if verdict is None else verdict.value))


DECLARED_ATTRIBUTE = "qconform_declared"  # on a skip exception: what ``session/declared_skips.py`` declares


def skip_not_claimed(reason: str) -> NoReturn:
    """Skip a test whose backend does not claim what it needs: no cell, said as a value (the
    message reads ``not claimed: <reason>``). For checks that learn it only while running."""
    __tracebackhide__ = True  # the skip's place is the caller's line, as pytest.skip's is
    _declared_skip(f"{NOT_CLAIMED_PREFIX} {reason}")


def skip_other_device(reason: str) -> NoReturn:
    """Skip an instance this run's device cannot compute (a CUDA graph on a CPU run): no cell,
    as for any instance of a device the run does not report on (``other device: <reason>``)."""
    __tracebackhide__ = True
    _declared_skip(f"{OTHER_DEVICE_PREFIX} {reason}")


def _declared_skip(message: str) -> NoReturn:
    __tracebackhide__ = True
    skip = pytest.skip.Exception(message)
    setattr(skip, DECLARED_ATTRIBUTE, NO_CELL)  # pytest's own Skipped: its message reads as any skip's
    raise skip


def _declared(report: pytest.TestReport) -> str | None:
    found = [value for name, value in report.user_properties if name == VERDICT_PROPERTY]
    return str(found[-1]) if found else None


def verdict_of(report: pytest.TestReport) -> tuple[Verdict, str] | None:
    """(verdict, message) of one phase's report, or None when the phase says nothing.

    A verdict the session declared (``declare``) is taken as it is; the message prefixes are
    read only for skips raised elsewhere (the suites and downstream tests write the public
    ``NOT_CLAIMED_PREFIX`` and ``UNAVAILABLE_PREFIX``)."""
    if hasattr(report, "wasxfail"):
        if report.skipped:
            return Verdict.KNOWN_FAILURE, str(report.wasxfail)
        return Verdict.FAIL, _unexpected_pass(str(report.wasxfail))
    declared = _declared(report)
    if declared is not None and (report.failed or report.skipped):
        if declared == NO_CELL:
            return None
        return Verdict(declared), skip_reason(report) if report.skipped else _failure_message(report)
    if report.failed:
        if isinstance(report.longrepr, str) and report.longrepr.startswith(XPASS_STRICT_PREFIX):
            return Verdict.FAIL, _unexpected_pass(report.longrepr[len(XPASS_STRICT_PREFIX) :].strip())
        message = _failure_message(report)
        if TIMEOUT_MESSAGE in message:
            return Verdict.TIMEOUT, f"{message} (stopped in phase {report.when}: {report.nodeid})"
        return Verdict.FAIL, message
    if report.skipped:
        reason = skip_reason(report)
        if reason.startswith((NOT_CLAIMED_PREFIX, OTHER_DEVICE_PREFIX)):
            return None
        if reason.startswith(UNAVAILABLE_PREFIX):
            return Verdict.UNAVAILABLE, reason
        if reason.startswith(NOTHING_CLAIMED_PREFIX):
            return Verdict.NOT_CLAIMED, reason
        return Verdict.SKIPPED, reason
    if report.when == "call" and report.passed:
        return Verdict.PASS, ""
    return None


def case_from_report(report: pytest.TestReport) -> Case | None:
    """A case for one phase's report of a qconform-keyed item, else None."""
    key = case_key_of(report)
    if key is None:
        return None
    found = verdict_of(report)
    if found is None:
        return None
    verdict, message = found
    props = _props(report)
    return Case(
        report.nodeid,
        key.target,
        one_case_cell(key, verdict, props.get(MULTIPLE_PROPERTY), message, str(props.get(REPRO_PROPERTY, ""))),
        tuple(sorted(dict(props.get(AXES_PROPERTY) or {}).items())),
        tuple(sorted((axis, tuple(found)) for axis, found in dict(props.get(CLAIMED_AXES_PROPERTY) or {}).items())),
    )


def identity_of(report: pytest.TestReport) -> tuple[CaseKey, str] | None:
    """(case key, repro) a report carries, for the recorder to remember until a crash."""
    key = case_key_of(report)
    return (key, str(dict(report.user_properties).get(REPRO_PROPERTY, ""))) if key else None


def is_worker_crash(report: pytest.TestReport) -> bool:
    """Whether this is pytest-xdist's report of a worker process that died mid-test."""
    return bool(report.failed and isinstance(report.longrepr, str) and WORKER_CRASH_MARK in report.longrepr)


def crash_case(
    report: pytest.TestReport, key: CaseKey, repro: str, elapsed_s: float | None, timeout_s: float | None
) -> Case:
    """The case of a test whose worker died: ``timeout`` when it ran for at least the
    pytest-timeout limit (the thread method kills the process), else ``crashed`` (a
    segfault, an abort, a GPU exception). The message names the test and its cell."""
    where = f"{report.nodeid} ({key.describe()})"
    ran = f" after {elapsed_s:.1f} s" if elapsed_s is not None else ""
    if timeout_s and elapsed_s is not None and elapsed_s >= timeout_s:
        verdict = Verdict.TIMEOUT
        message = f"timed out{ran} (limit {timeout_s:g} s): pytest-timeout killed the worker while running {where}"
    else:
        verdict = Verdict.CRASHED
        message = (
            f"the test process died{ran} (segfault, abort or device exception) while running {where}; {report.longrepr}"
        )
    return Case(report.nodeid, key.target, one_case_cell(key, verdict, None, message, repro))


def worse(a: Case | None, b: Case) -> Case:
    """The case to keep when one item reports two phases (setup and call, call and teardown)."""
    # Worse verdicts override milder ones when an item reports several phases.
    if a is None or Verdict(b.verdict).severity >= Verdict(a.verdict).severity:
        return b
    return a
