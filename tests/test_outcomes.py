"""Verdicts and keys travel as values: a skip or failure the session raises declares what it
means (``outcomes.declare``), and the recorder reads that value, not a prefix of the message; a
test's ``CaseKey`` goes out and comes back through ``attach_key`` and ``case_key_of`` only."""

from __future__ import annotations

import pytest

from pytest_qconform.session import outcomes
from pytest_qconform.vocabulary import CaseKey, Verdict


def _report(outcome: str, longrepr, when: str = "setup", declared: Verdict | None = None) -> pytest.TestReport:
    properties: list[tuple[str, object]] = []
    if declared is not None:
        outcomes.declare(properties, declared)
    return pytest.TestReport(
        "test_x.py::test_x", ("test_x.py", 1, "test_x"), {}, outcome, longrepr, when, user_properties=properties
    )


def test_a_declared_skip_is_read_by_its_value_whatever_its_words():
    report = _report("skipped", ("test_x.py", 1, "Skipped: gemlite is not installed"), declared=Verdict.UNAVAILABLE)
    assert outcomes.verdict_of(report) == (Verdict.UNAVAILABLE, "gemlite is not installed")


def test_a_declared_failure_is_read_by_its_value():
    report = _report("failed", "not run: the device is unusable", declared=Verdict.CRASHED)
    assert outcomes.verdict_of(report) == (Verdict.CRASHED, "not run: the device is unusable")


def test_a_skip_raised_elsewhere_is_still_read_by_its_public_prefix():
    """The suites and downstream tests skip with ``UNAVAILABLE_PREFIX``, ``NOT_CLAIMED_PREFIX``."""
    unavailable = _report("skipped", ("test_x.py", 1, f"Skipped: {outcomes.UNAVAILABLE_PREFIX} mine: no GPU"))
    assert outcomes.verdict_of(unavailable) == (Verdict.UNAVAILABLE, f"{outcomes.UNAVAILABLE_PREFIX} mine: no GPU")
    not_claimed = _report("skipped", ("test_x.py", 1, f"Skipped: {outcomes.NOT_CLAIMED_PREFIX} fp4"))
    assert outcomes.verdict_of(not_claimed) is None
    plain = _report("skipped", ("test_x.py", 1, "Skipped: needs two GPUs"))
    assert outcomes.verdict_of(plain) == (Verdict.SKIPPED, "needs two GPUs")


def test_a_declared_verdict_does_not_outrank_a_known_failure():
    report = _report("skipped", ("test_x.py", 1, "Skipped: x"), when="call", declared=Verdict.UNAVAILABLE)
    report.wasxfail = "known failure (link): why [f.toml:1]"  # type: ignore[attr-defined]
    assert outcomes.verdict_of(report) == (Verdict.KNOWN_FAILURE, "known failure (link): why [f.toml:1]")


def test_a_declared_no_cell_skip_makes_no_cell_whatever_its_words():
    report = _report("skipped", ("test_x.py", 1, "Skipped: anything"))
    outcomes.declare(report.user_properties, None)
    assert outcomes.verdict_of(report) is None


@pytest.mark.parametrize(
    ("skip", "prefix"),
    [("skip_not_claimed", outcomes.NOT_CLAIMED_PREFIX), ("skip_other_device", outcomes.OTHER_DEVICE_PREFIX)],
)
def test_a_no_cell_skip_declares_it_on_the_report(
    fake_backend_project: pytest.Pytester, skip: str, prefix: str
) -> None:
    """The suites' not-claimed and other-device skips travel as a value: the report carries it,
    the recorder makes no cell of the instance, and the reason still reads "not claimed: ..."."""
    fake_backend_project.makepyfile(
        test_suite=f"""
import pytest
from pytest_qconform.session.outcomes import {skip}

@pytest.mark.qconform_operation("dequantize")
def test_dequantize(qtarget, qbackend):
    {skip}("no such layout")
"""
    )
    recorder = fake_backend_project.inline_run(
        str(fake_backend_project.path / "test_suite.py"),
        "--qconform",
        "--qconform-backend=fake",
        "--qconform-no-report",
    )
    (skipped,) = [r for r in recorder.getreports("pytest_runtest_logreport") if r.skipped]
    assert (outcomes.VERDICT_PROPERTY, outcomes.NO_CELL) in skipped.user_properties
    assert outcomes.skip_reason(skipped) == f"{prefix} no such layout"
    assert outcomes.case_from_report(skipped) is None
    assert skipped.longrepr[0].endswith("test_suite.py")  # the caller's place, as pytest.skip's


def test_a_case_key_comes_back_from_a_serialized_report_as_the_key_attached():
    """pytest-xdist sends a report's properties to the controller as plain data: the key
    attached at collection is read back from the report's round trip, equal and typed."""
    key = CaseKey("bitsandbytes", "matmul", "nf4-b64", "bf16", "cpu")
    properties: list[tuple[str, object]] = []
    item = type("Item", (), {"user_properties": properties})()
    outcomes.attach_key(item, key)
    report = pytest.TestReport("t.py::t", ("t.py", 1, "t"), {}, "passed", None, "call", user_properties=properties)
    sent = pytest.TestReport._from_json(report._to_json())
    assert outcomes.case_key_of(sent) == key
    assert outcomes.case_key_of(sent).cell == ("bitsandbytes", "matmul", "nf4-b64", "bf16")


@pytest.mark.parametrize("wire", [None, "bitsandbytes", {"backend": "x", "operation": "y"}, ("a", "b", "c", "d", "e")])
def test_anything_but_a_whole_key_reads_as_no_key(wire):
    assert CaseKey.from_wire(wire) is None
