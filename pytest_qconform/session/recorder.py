"""Collects each test's outcome into matrix cases (and each benchmark's timing) and writes
the run report at the end."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import time
from pathlib import Path
from typing import cast

import pytest

from pytest_qconform.session import instance_slice, outcomes, stale_known_failures, state
from pytest_qconform.session.applicability import NOT_HERE, from_worker
from pytest_qconform.vocabulary import CaseKey, CellKey, Verdict

# pytest-benchmark's skip of every non-benchmark test under --benchmark-only: it says
# nothing about conformance, so a benchmark run's report holds no cells.
BENCHMARK_ONLY_SKIP = "(--benchmark-only active)"
SHORT_CIRCUIT_PLUGIN = "qconform-short-circuit"


class RunRecorder:
    """A plugin object (one per session, holding its config) registered by ``--qconform``."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.nothing_checked: str | None = None  # why, when the run recorded no cell
        self.collected = 0
        self.deselected = 0
        self.uncounted_skips: list[str] = []  # "not claimed" / "other device" reasons: no cell
        # pytest-xdist: the tests the workers collected, and those that reported. xdist stops
        # for good after --max-worker-restart crashes; the tests it never ran say nothing.
        self.scheduled: set[str] = set()
        self.reported: set[str] = set()
        self.never_ran: str | None = None
        # Under pytest-xdist a dead worker's report carries no properties: remember each
        # test's cell key and start time from its earlier reports (see outcomes.crash_case).
        self.identities: dict[str, tuple[CaseKey, str]] = {}
        self.started: dict[str, float] = {}
        self.benchmarks: list[dict] = []  # Benchmark.to_dict() of each timed case, in run order
        self.calls: dict[str, tuple[str, dict]] = {}  # nodeid -> (operation, the call-site oracle's summary)

    def pytest_deselected(self, items: list) -> None:
        self.deselected += len(items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected = len(session.items)

    def pytest_runtest_logstart(self, nodeid: str, location: tuple) -> None:
        self.started[nodeid] = time.monotonic()

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids: list[str]) -> None:
        self.scheduled.update(ids)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:  # pytest-xdist, controller: a worker finished
        output = getattr(node, "workeroutput", None) or {}
        from_worker(self.config, output)
        instance_slice.from_worker(self.config, output)
        stale_known_failures.from_worker(self.config, output)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.reported.add(report.nodeid)
        self._collect_calls(report)
        if report.when == "call" and report.passed:
            from pytest_qconform.benchmark.harness import PROPERTY

            self.benchmarks += [cast(dict, value) for name, value in report.user_properties if name == PROPERTY]
        if report.skipped and BENCHMARK_ONLY_SKIP in str(report.longrepr):
            return
        if outcomes.is_worker_crash(report):
            identity = self.identities.get(report.nodeid)
            if identity is None:
                return  # died before its setup reported: no cell to charge (pytest reports the crash)
            start = self.started.get(report.nodeid)
            elapsed = time.monotonic() - start if start is not None else None
            case: outcomes.Case | None = outcomes.crash_case(report, *identity, elapsed, _timeout_limit(self.config))
        else:
            identity = outcomes.identity_of(report)
            if identity is not None:
                self.identities[report.nodeid] = identity
            case = _with_comparative(outcomes.case_from_report(report), report)
            if case is None and report.skipped and identity is not None:
                self.uncounted_skips.append(outcomes.skip_reason(report))
        if case is not None:
            short_circuit = self.config.pluginmanager.get_plugin(SHORT_CIRCUIT_PLUGIN)
            if short_circuit is not None:
                short_circuit.trip(case)
            cases = self.config.stash[state.CASES]
            cases[case.nodeid] = outcomes.worse(cases.get(case.nodeid), case)

    def _collect_calls(self, report: pytest.TestReport) -> None:
        from pytest_qconform.report.calls import CALLS_PROPERTY

        summary, key = dict(report.user_properties).get(CALLS_PROPERTY), outcomes.case_key_of(report)
        if summary and key is not None:
            self.calls[report.nodeid] = (key.operation, cast(dict, summary))

    def cells(self) -> list:
        from pytest_qconform.report.cells import Cell, fold_cell

        grouped: dict[CellKey, list[Cell]] = {}
        # In test-id order, not in the order the results arrived: a cell's reason and first
        # failure are those of its first test by id, the same in a serial run and under
        # pytest-xdist, whose workers finish in a different order every run.
        for _, case in sorted(self.config.stash[state.CASES].items()):
            grouped.setdefault(case.cell.key, []).append(case.cell)
        return [fold_cell(group) for _, group in sorted(grouped.items())]

    def _computed_cases(self) -> list:
        """The cases that computed something (pass, fail, known failure, crash, timeout): a
        run whose every case skipped (another device's, a missing extra, an unavailable
        backend) checked nothing, whatever cells it records."""
        skipped = (Verdict.SKIPPED, Verdict.UNAVAILABLE, Verdict.NOT_CLAIMED)
        return [case for case in self.config.stash[state.CASES].values() if case.verdict not in skipped]

    def _why_nothing_was_checked(self) -> str:
        """Why a run recorded no cell, and what to try: for a run that must fail on it."""
        cases = sorted(self.config.stash[state.CASES].items())
        if cases:
            what = (
                f"all {len(cases)} recorded cases were skipped, unavailable or not claimed, e.g. "
                f"{cases[0][1].message!r}"
            )
        elif self.collected == 0:
            what = (
                f"all {self.deselected} collected tests were deselected (by -k, -m, --qconform-format, "
                "--qconform-dtype, or as not applying here: see above)"
                if self.deselected
                else "no test was collected"
            )
        elif self.uncounted_skips:
            what = (
                f"{len(self.uncounted_skips)} of the {self.collected} selected tests were skipped as not "
                f"applying here (not claimed by the backend, or for another device), e.g. "
                f"{self.uncounted_skips[0]!r}"
            )
        else:
            what = (
                f"the {self.collected} selected tests record no matrix cell (benchmarks, and tests without the "
                "qbackend fixture, do not)"
            )
        return (
            f"qconform: nothing was checked, so this run fails (exit code {int(pytest.ExitCode.NO_TESTS_COLLECTED)})"
            f": no conformance cell was computed; {what} (probe: {state.probe(self.config).summary()}). "
            "`pytest --qconform --collect-only -q` lists the tests, `python -m pytest_qconform doctor` what "
            "this machine has."
        )

    def _never_ran(self) -> str | None:
        """Under pytest-xdist: tests collected but never reported (xdist gave up), or None."""
        missing = sorted(self.scheduled - self.reported)
        if not missing:
            return None
        return (
            f"qconform: {len(missing)} of {len(self.scheduled)} collected tests never ran, so they have no "
            "verdict and this run fails: pytest-xdist stopped (after --max-worker-restart worker crashes, or "
            f"interrupted); first: {missing[0]}. Allow more restarts, or see docs/fault-isolation.md."
        )

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        worker = hasattr(self.config, "workerinput")
        self.never_ran = None if worker else self._never_ran()
        if self.never_ran and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        timing_only = self.config.getoption("benchmark_only", False)  # pytest-benchmark: no cells by design
        if (
            not worker
            and not timing_only
            and not self.config.getoption("collectonly")
            and not self._computed_cases()
            and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        ):
            self.nothing_checked = self._why_nothing_was_checked()
            session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED
        if (
            worker or self.config.getoption("qconform_no_report") or self.config.getoption("collectonly")
        ):  # nothing ran: nothing to report
            return
        from pytest_qconform.report.benchmarks import Benchmark, with_bitsandbytes_ratios
        from pytest_qconform.report.records import load
        from pytest_qconform.report.run_report import RunReport, write_report
        from pytest_qconform.report.storage import ReportsFolder

        folder = ReportsFolder.for_run(
            self.config.getoption("qconform_report_dir") or self.config.getini("qconform_report_dir"),
            Path(self.config.invocation_params.dir),
        ).root
        created = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        benchmarks = with_bitsandbytes_ratios(
            load(Benchmark, data, f"benchmark of {data.get('nodeid')}") for data in self.benchmarks
        )
        from pytest_qconform.report.calls import merged
        from pytest_qconform.report.contract import current_suite
        from pytest_qconform.report.coverage import from_cases

        report = RunReport(
            probe=state.probe(self.config).to_dict(),
            cells=tuple(self.cells()),
            created=created,
            benchmarks=benchmarks,
            coverage=from_cases(self.config.stash[state.CASES].values()),
            calls=merged(entry for _, entry in sorted(self.calls.items())),
            stale_known_failures=self.config.stash.get(stale_known_failures.STALE, ()),
            suite=current_suite(),
        )
        self.config.stash[state.REPORT_PATH] = str(write_report(report, folder))
        self.report = report

    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        tr.section("qconform matrix")
        not_here = self.config.stash.get(NOT_HERE, None)
        if not_here is not None and not_here.total:
            tr.write_line(not_here.line())
        sliced = self.config.stash.get(instance_slice.SLICE, None)
        if sliced is not None:
            tr.write_line(sliced.line())
        stale = stale_known_failures.summary_line(self.config.stash.get(stale_known_failures.STALE, ()))
        if stale:
            tr.write_line(stale, yellow=True)
        if self.nothing_checked:
            tr.write_line(self.nothing_checked, red=True, bold=True)
        if self.never_ran:
            tr.write_line(self.never_ran, red=True, bold=True)
        report = getattr(self, "report", None)
        if report is not None:
            from pytest_qconform.report.tables import format_arch_table

            tr.write_line(format_arch_table(report))
            if report.benchmarks:
                from pytest_qconform.report.tables import format_bench_table

                tr.write_line(format_bench_table(report))
        path = self.config.stash.get(state.REPORT_PATH, None)
        if path:
            tr.write_line(f"qconform report: {path}")


def _with_comparative(case: outcomes.Case | None, report: pytest.TestReport) -> outcomes.Case | None:
    """``case`` with the worst comparative ratio its test recorded (``Checker.comparative``,
    ``reference.comparative``) in its cell, beside the bound's multiple; NaN counts as worst."""
    if case is None:
        return None
    from pytest_qconform.report.cells import COMPARATIVE_PROPERTY

    ratios = [float(cast(float, value)) for name, value in report.user_properties if name == COMPARATIVE_PROPERTY]
    if not ratios:
        return case
    worst = math.nan if any(math.isnan(r) for r in ratios) else max(ratios)
    return dataclasses.replace(case, cell=dataclasses.replace(case.cell, worst_comparative_ratio=worst))


def _timeout_limit(config: pytest.Config) -> float | None:
    """The run's pytest-timeout limit in seconds, or None without one."""
    if not config.pluginmanager.hasplugin("timeout"):
        return None
    from pytest_timeout import get_env_settings

    return get_env_settings(config).timeout or None
