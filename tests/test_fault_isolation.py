"""Fault injection: deliberately broken fake backends end in the right verdict, in a
complete report, and the other backends' tests are unaffected.

Crashes and hangs run in a subprocess under pytest-xdist (a dead worker is replaced)
with pytest-timeout; everything else runs in-process.
"""

import json
import re
import textwrap

import pytest
import torch  # noqa: F401
from fake_backend import FAKE_BACKEND

import pytest_qconform.backends.base  # noqa: F401

# torch and the backend base classes are held by this process: pytester's in-process runs
# drop the modules they import, and torch cannot be imported twice in one process.

BROKEN_BACKENDS_CONFTEST = FAKE_BACKEND + textwrap.dedent('''
    import ctypes
    import importlib
    import os
    import time

    class GoodBackend(FakeBackend):
        """Computes x @ W.T for an all-ones W of 4 rows: each output is the row sum of x."""
        name = "good"

        def matmul(self, x, q, bias, compute_dtype):
            return x.sum(-1, keepdim=True).expand(x.shape[0], 4).to(compute_dtype)

    class NanBackend(GoodBackend):
        name = "nan"

        def matmul(self, x, q, bias, compute_dtype):
            return torch.full((x.shape[0], 4), float("nan"), dtype=compute_dtype)

    class OomBackend(GoodBackend):
        name = "oom"

        def matmul(self, x, q, bias, compute_dtype):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    class AbortBackend(GoodBackend):
        name = "abort"

        def matmul(self, x, q, bias, compute_dtype):
            os.abort()

    class SegfaultBackend(GoodBackend):
        name = "segfault"

        def matmul(self, x, q, bias, compute_dtype):
            return ctypes.string_at(0)

    class HangBackend(GoodBackend):
        name = "hang"

        def matmul(self, x, q, bias, compute_dtype):
            time.sleep(300)

    class NoBinaryBackend(GoodBackend):
        name = "nobinary"

        def availability(self):
            return Availability(False, None, "hipErrorNoBinaryForGpu: Unable to find code object for all "
                                             "current devices!")

    class RaisingConstructorBackend(GoodBackend):
        name = "badinit"

        def __init__(self):
            raise RuntimeError("libbroken.so: cannot open shared object file")

    class SurvivorBackend(GoodBackend):
        name = "survivor"

    LOST_DEVICE = []  # the sticky error a faulting kernel leaves behind, in this process

    class PoisonBackend(GoodBackend):
        """Faults the way a misaligned CUDA load does: the device stays unusable afterwards."""
        name = "poison"

        def matmul(self, x, q, bias, compute_dtype):
            LOST_DEVICE.append("CUDA error: misaligned address")
            raise RuntimeError("CUDA error: misaligned address")

    import pytest_qconform.session.device_loss

    pytest_qconform.session.device_loss.device_error = lambda device: LOST_DEVICE[0] if LOST_DEVICE else None

    def import_missing_library():
        importlib.import_module("qconform_no_such_library")

    def pytest_qconform_backends(config):
        return {"good": GoodBackend, "nan": NanBackend, "oom": OomBackend, "abort": AbortBackend,
                "segfault": SegfaultBackend, "hang": HangBackend, "nobinary": NoBinaryBackend,
                "badinit": RaisingConstructorBackend, "noimport": import_missing_library,
                "poison": PoisonBackend, "survivor": SurvivorBackend}
''')

SUITE = """
import pytest
import torch

@pytest.mark.qconform_operation("matmul")
def test_matmul_matches_reference(qbackend, qcheck):
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = qbackend.matmul(x, None, None, torch.float32)
    expected = x.double().sum(-1, keepdim=True).expand(2, 4)
    qcheck.within(out, expected, torch.full_like(expected, 1e-6), "matmul")
"""

NAN_KNOWN_FAILURE = """
[[failure]]
backend = "nan"
versions = "==1.0"
arch = "cpu"
check = "matmul"
reason = "matmul returns NaN"
link = "https://example.invalid/nan"
repro = "NanBackend().matmul(x, None, None, torch.float32)"
"""


@pytest.fixture
def broken_project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(BROKEN_BACKENDS_CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def backends(*names: str) -> list[str]:
    return [f"--qconform-backend={name}" for name in names]


def matmul_cells(pytester: pytest.Pytester) -> dict[str, dict]:
    """The one written report's cells by backend (all are the matmul cell)."""
    from pytest_qconform.report.run_report import read_report

    paths = list((pytester.path / "out").glob("*.json"))
    assert len(paths) == 1, paths
    report = read_report(paths[0])  # validates the schema: the report is complete
    cells = json.loads(paths[0].read_text())["cells"]
    assert {c.operation for c in report.cells} == {"matmul"}
    return {c["backend"]: c for c in cells}


def run_in_process(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(
        str(pytester.path / "test_suite.py"), "--qconform", "--qconform-report-dir=out", "-p", "no:cacheprovider", *args
    )


def test_broken_backends_end_in_their_verdicts_and_the_good_one_passes(broken_project: pytest.Pytester) -> None:
    result = run_in_process(broken_project, *backends("good", "nobinary", "badinit", "noimport", "nan", "oom"), "-rs")
    result.assert_outcomes(passed=1, failed=1, skipped=4)
    cells = matmul_cells(broken_project)
    assert {name: cell["verdict"] for name, cell in cells.items()} == {
        "good": "pass",
        "nobinary": "unavailable",
        "badinit": "unavailable",
        "noimport": "unavailable",
        "nan": "fail",
        "oom": "skipped",
    }
    # Availability reports the HIP error; a raising constructor or import becomes the reason.
    assert "hipErrorNoBinaryForGpu" in cells["nobinary"]["reason"]
    assert "RuntimeError: libbroken.so: cannot open shared object file" in cells["badinit"]["reason"]
    assert "ModuleNotFoundError: No module named 'qconform_no_such_library'" in cells["noimport"]["reason"]
    result.stdout.fnmatch_lines(["*backend badinit: unavailable: could not be built: RuntimeError*"])
    # NaN against a finite reference is never within bound.
    assert cells["nan"]["worst_error_multiple"] == "inf"
    assert "got nan" in cells["nan"]["first_failure"]["message"]
    # Out of device memory skips the case, with the reason.
    assert cells["oom"]["reason"] == "out of memory: CUDA out of memory. Tried to allocate 64.00 GiB"
    result.stdout.fnmatch_lines(["*out of memory: CUDA out of memory*"])


def test_a_hang_stopped_in_process_is_a_timeout(broken_project: pytest.Pytester) -> None:
    # pytest-timeout's signal method: the hung test fails in-process and the run goes on.
    result = run_in_process(broken_project, *backends("good", "hang"), "--timeout=1", "--timeout-method=signal")
    result.assert_outcomes(passed=1, failed=1)
    cells = matmul_cells(broken_project)
    assert cells["good"]["verdict"] == "pass"
    assert cells["hang"]["verdict"] == "timeout"
    assert "Timeout (>1.0s) from pytest-timeout" in cells["hang"]["first_failure"]["message"]


def test_killed_workers_are_crashed_and_timeout_and_the_run_completes(broken_project: pytest.Pytester) -> None:
    # abort, segfault and hang (killed by the thread method) each take their worker down; xdist
    # starts another and the remaining tests still run. The report is the controller's;
    # a known failure marked on a worker reaches it too.
    broken_project.makefile(".toml", known=NAN_KNOWN_FAILURE)
    result = broken_project.runpytest_subprocess(
        str(broken_project.path / "test_suite.py"),
        "--qconform",
        "--qconform-report-dir=out",
        "-p",
        "no:cacheprovider",
        *backends("abort", "good", "hang", "nan", "oom", "segfault"),
        "--qconform-known-failures=known.toml",
        "-n",
        "1",
        "--max-worker-restart=5",
        "--timeout=2",
        "--timeout-method=thread",
    )
    result.assert_outcomes(passed=1, failed=3, skipped=1, xfailed=1)
    result.stdout.fnmatch_lines(["*worker 'gw0' crashed while running*abort*"])
    cells = matmul_cells(broken_project)
    assert {name: cell["verdict"] for name, cell in cells.items()} == {
        "abort": "crashed",
        "segfault": "crashed",
        "hang": "timeout",
        "good": "pass",
        "oom": "skipped",
        "nan": "known-failure",
    }
    for name in ("abort", "segfault", "hang"):
        failure = cells[name]["first_failure"]
        assert (
            f"test_matmul_matches_reference[{name}]" in failure["message"] and f"backend={name}" in failure["message"]
        )
        assert f"test_matmul_matches_reference[{name}]" in failure["repro"]
    assert "the test process died" in cells["abort"]["first_failure"]["message"]
    assert "the test process died" in cells["segfault"]["first_failure"]["message"]
    assert "pytest-timeout killed the worker" in cells["hang"]["first_failure"]["message"]
    result.stdout.fnmatch_lines(["*qconform report: *.json"])


SHORT_CIRCUIT_SUITE = """
import pytest
import torch

@pytest.mark.qconform_operation("matmul")
@pytest.mark.parametrize("case", range(3))
def test_matmul(qbackend, qcheck, case):
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = qbackend.matmul(x, None, None, torch.float32)
    expected = x.double().sum(-1, keepdim=True).expand(2, 4)
    qcheck.within(out, expected, torch.full_like(expected, 1e-6), "matmul")

@pytest.mark.qconform_operation("dequantize")
def test_other_operation(qbackend):
    pass
"""


def all_cells(pytester: pytest.Pytester) -> dict[tuple[str, str], dict]:
    (path,) = (pytester.path / "out").glob("*.json")
    return {(c["backend"], c["operation"]): c for c in json.loads(path.read_text())["cells"]}


def test_after_a_timeout_the_backends_other_cases_of_that_operation_end_at_once(
    broken_project: pytest.Pytester,
) -> None:
    broken_project.makepyfile(test_suite=SHORT_CIRCUIT_SUITE)
    result = run_in_process(broken_project, *backends("good", "hang"), "--timeout=2", "--timeout-method=signal")
    result.assert_outcomes(passed=5, failed=3)
    result.stdout.fnmatch_lines(
        [
            "*timeout after an earlier timeout in "
            "test_suite.py::test_matmul?hang-0?: not run: hang's remaining matmul tests end at "
            "once (--qconform-after-crash=operation; 'continue' runs them)"
        ]
    )
    cells = all_cells(broken_project)
    assert cells["hang", "matmul"]["verdict"] == "timeout" and cells["hang", "matmul"]["cases"] == 3
    assert "Timeout (>2.0s) from pytest-timeout" in cells["hang", "matmul"]["first_failure"]["message"]
    assert cells["hang", "dequantize"]["verdict"] == "pass"  # another operation still runs
    assert cells["good", "matmul"]["verdict"] == "pass"


@pytest.mark.parametrize(
    "rule, crashes, verdicts",
    [
        ("operation", 1, {"matmul": "crashed", "dequantize": "pass"}),
        ("backend", 1, {"matmul": "crashed", "dequantize": "crashed"}),
        ("continue", 3, {"matmul": "crashed", "dequantize": "pass"}),
    ],
)
def test_after_a_crash_under_xdist_the_rule_decides_what_still_runs(
    broken_project: pytest.Pytester, rule: str, crashes: int, verdicts: dict
) -> None:
    broken_project.makepyfile(test_suite=SHORT_CIRCUIT_SUITE)
    result = broken_project.runpytest_subprocess(
        str(broken_project.path / "test_suite.py"),
        "--qconform",
        "--qconform-report-dir=out",
        "-p",
        "no:cacheprovider",
        *backends("abort", "good"),
        f"--qconform-after-crash={rule}",
        "-n",
        "1",
        "--max-worker-restart=5",
        "--timeout=60",
        "--timeout-method=thread",
    )
    assert len(set(re.findall(r"worker '(gw\d+)' crashed while running", result.stdout.str()))) == crashes
    cells = all_cells(broken_project)
    assert {op: cells["abort", op]["verdict"] for op in verdicts} == verdicts
    assert cells["good", "matmul"]["verdict"] == "pass" and cells["good", "dequantize"]["verdict"] == "pass"
    if rule != "continue":
        result.stdout.fnmatch_lines(
            [
                f"*crashed after an earlier crash in test_suite.py::test_matmul?abort-0?: not "
                f"run*--qconform-after-crash={rule}*"
            ]
        )


def test_tests_that_xdist_never_ran_are_named_and_fail_the_run(broken_project: pytest.Pytester) -> None:
    """Past --max-worker-restart, xdist stops and the tests it did not run have no verdict:
    the run says how many, and fails even when everything that ran passed."""
    broken_project.makepyfile(test_suite=SHORT_CIRCUIT_SUITE)
    result = broken_project.runpytest_subprocess(
        str(broken_project.path / "test_suite.py"),
        "--qconform",
        "--qconform-report-dir=out",
        "-p",
        "no:cacheprovider",
        *backends("abort", "good"),
        "--qconform-after-crash=continue",
        "-n",
        "1",
        "--max-worker-restart=0",
        "--timeout=60",
        "--timeout-method=thread",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "qconform: * of 8 collected tests never ran, so they have no verdict and this run "
            "fails: pytest-xdist stopped (after --max-worker-restart worker crashes*"
        ]
    )


def test_a_test_that_leaves_its_device_unusable_is_a_crash_and_later_tests_end_at_once(
    broken_project: pytest.Pytester,
) -> None:
    """In one process, a sticky device error is charged to the test that caused it, not to
    every later test: those end at once, naming it and the remedy."""
    broken_project.makepyfile(test_suite=SHORT_CIRCUIT_SUITE)
    result = run_in_process(broken_project, *backends("good", "poison", "survivor"))
    cells = all_cells(broken_project)
    assert cells["good", "matmul"]["verdict"] == "pass"
    assert cells["poison", "matmul"]["verdict"] == "crashed"
    assert cells["poison", "matmul"]["first_failure"]["message"].startswith(
        "device lost: cpu became unusable in test_suite.py::test_matmul[poison-0] (CUDA error: misaligned address)"
    )
    assert cells["survivor", "matmul"]["verdict"] == "crashed"
    result.stdout.fnmatch_lines(
        [
            "*crashed after an earlier crash in test_suite.py::test_matmul?poison-0?: not run: "
            "cpu is unusable in this process*run with -n 1*"
        ]
    )


def test_under_xdist_a_lost_device_costs_one_worker(broken_project: pytest.Pytester) -> None:
    """The worker ends itself on a lost device: xdist reports the test crashed, a fresh
    worker (a fresh device context) runs the rest, and only that backend's operation ends."""
    broken_project.makepyfile(test_suite=SHORT_CIRCUIT_SUITE)
    broken_project.runpytest_subprocess(
        str(broken_project.path / "test_suite.py"),
        "--qconform",
        "--qconform-report-dir=out",
        "-p",
        "no:cacheprovider",
        *backends("good", "poison", "survivor"),
        "-n",
        "1",
        "--max-worker-restart=5",
    )
    cells = all_cells(broken_project)
    assert cells["poison", "matmul"]["verdict"] == "crashed" and cells["poison", "matmul"]["cases"] == 3
    assert {key: cell["verdict"] for key, cell in cells.items() if key != ("poison", "matmul")} == {
        ("good", "matmul"): "pass",
        ("good", "dequantize"): "pass",
        ("poison", "dequantize"): "pass",
        ("survivor", "matmul"): "pass",
        ("survivor", "dequantize"): "pass",
    }
