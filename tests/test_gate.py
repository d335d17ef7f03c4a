"""The report gate (``python -m pytest_qconform check``): what a CI job requires of a run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pytest_qconform.report import gate
from pytest_qconform.report.cells import Cell
from pytest_qconform.report.gate import CellPattern, GateUsageError, problems
from pytest_qconform.report.run_report import RunReport, write_report

PROBE = {
    "device_kind": "cpu",
    "arch": "x86_64",
    "device_name": "x86_64",
    "host": "h",
    "torch": "2.13.0",
    "cuda": None,
    "hip": None,
    "simulated": False,
    "backends": {},
}
FAILURE = {"message": "dequantize vs reference: error is 7 x its bound", "repro": "pytest --qconform -k x"}
CELLS = (
    Cell("torch-nf4", "dequantize", "nf4-b64", "fp32", "pass", worst_error_multiple=0.5),
    Cell("torch-nf4", "matmul", "nf4-b64", "fp32", "known-failure", reason="tracked upstream"),
    Cell("torch-nf4-broken", "dequantize", "nf4-b64", "fp32", "fail", first_failure=FAILURE),
    Cell("torch-nf4-broken", "dequantize", "nf4-b64", "bf16", "fail", first_failure=FAILURE),
    Cell("torch-nf4-broken", "quantize", "nf4-b64", "-", "pass"),
    Cell("gone", "matmul", "nf4-b64", "fp32", "unavailable", reason="unavailable: gone: import failed"),
)


def report(*cells: Cell, **probe) -> RunReport:
    return RunReport(probe={**PROBE, **probe}, cells=cells, created="2026-01-01T00:00:00Z")


def expect(*texts: str) -> list[CellPattern]:
    return [CellPattern.parse(text) for text in texts]


def test_a_passing_backend_meets_both_requirements() -> None:
    assert problems(report(*CELLS), ["torch-nf4"]) == []
    assert problems(report(*CELLS), ["torch-nf4"], "pass") == []  # a known failure is not a problem


def test_failing_cells_fail_the_gate_each_named_with_its_message() -> None:
    found = problems(report(*CELLS), ["torch-nf4-broken"])
    assert found == [
        "torch-nf4-broken/dequantize/nf4-b64/fp32: fail (dequantize vs reference: error is 7 x its bound)",
        "torch-nf4-broken/dequantize/nf4-b64/bf16: fail (dequantize vs reference: error is 7 x its bound)",
    ]


def test_require_pass_says_one_line_per_reason_with_a_count() -> None:
    """A CPU report's 27 unavailable hqq-gemlite cells were 27 lines of one reason."""
    missing = "unavailable: hqq-gemlite: gemlite is not installed"
    cells = [Cell("hqq-gemlite", op, "nf4-b64", "fp32", "unavailable", reason=missing) for op in "abcde"]
    cells.append(Cell("hqq-gemlite", "f", "nf4-b64", "fp32", "skipped", reason="needs 2 GPUs"))
    cells.append(CELLS[0])
    assert problems(report(*cells), require="pass") == [
        f"5 cells unavailable ({missing}): hqq-gemlite/a/nf4-b64/fp32, hqq-gemlite/b/nf4-b64/fp32, "
        "hqq-gemlite/c/nf4-b64/fp32 and 2 more",
        "hqq-gemlite/f/nf4-b64/fp32: skipped (needs 2 GPUs)",
    ]


@pytest.mark.parametrize("verdict", ["crashed", "timeout"])
def test_crashes_and_timeouts_fail_the_default_gate(verdict: str) -> None:
    cell = Cell("b", "matmul", "nf4-b64", "fp32", verdict, first_failure=FAILURE)
    assert problems(report(cell, Cell("b", "dequantize", "nf4-b64", "fp32", "pass"))) != []


def test_expected_failures_must_exist_and_fail_and_are_exempt() -> None:
    broken = ["torch-nf4-broken"]
    assert problems(report(*CELLS), broken, "pass", expect("torch-nf4-broken/dequantize")) == []
    assert problems(report(*CELLS), broken, "no-fail", expect("*-broken/dequantize/nf4-*/*")) == []
    assert problems(report(*CELLS), ["torch-nf4"], "no-fail", expect("torch-nf4/dequantize")) == [
        "torch-nf4/dequantize/nf4-b64/fp32: pass, expected fail (--expect-fail torch-nf4/dequantize)"
    ]
    assert problems(report(*CELLS), broken, "no-fail", expect("torch-nf4-broken/matmul")) == [
        "--expect-fail torch-nf4-broken/matmul: no cell matches",
        "torch-nf4-broken/dequantize/nf4-b64/fp32: fail (dequantize vs reference: error is 7 x its bound)",
        "torch-nf4-broken/dequantize/nf4-b64/bf16: fail (dequantize vs reference: error is 7 x its bound)",
    ]
    # --require any: a broken backend's failures in other operations are not judged, its expectations are.
    spread = Cell("torch-nf4-broken", "matmul", "nf4-b64", "fp32", "fail", first_failure=FAILURE)
    assert problems(report(*CELLS, spread), broken, "any", expect("torch-nf4-broken/dequantize")) == []
    assert problems(report(*CELLS, spread), broken, "any", expect("torch-nf4-broken/quantize")) == [
        "torch-nf4-broken/quantize/nf4-b64/-: pass, expected fail (--expect-fail torch-nf4-broken/quantize)"
    ]


def test_require_pass_also_refuses_unavailable_and_skipped_cells() -> None:
    assert problems(report(*CELLS), ["gone", "torch-nf4"], "no-fail")[0].startswith(
        "nothing was checked for backend 'gone'"
    )
    skipped = Cell("torch-nf4", "backward", "nf4-b64", "fp32", "skipped", reason="out of memory: 64 GiB")
    assert problems(report(*CELLS, skipped), ["torch-nf4"], "no-fail") == []
    assert problems(report(*CELLS, skipped), ["torch-nf4"], "pass") == [
        "torch-nf4/backward/nf4-b64/fp32: skipped (out of memory: 64 GiB)"
    ]


def test_a_run_that_checked_nothing_fails_the_gate() -> None:
    """The cases that let a CI go green by accident: no cells, only unavailable ones, a
    backend that was not selected, a simulated probe."""
    assert problems(report()) == [
        "nothing was checked for any backend: no computed cell (the report has no cell "
        "for it: was it registered and selected with --qconform-backend?)"
    ]
    only_unavailable = problems(report(CELLS[-1]))
    assert only_unavailable == [
        "nothing was checked for any backend: no computed cell (1 unavailable; e.g. unavailable: gone: import failed)"
    ]
    assert "backend 'mine'" in problems(report(*CELLS), ["mine"])[0]
    assert problems(report(*CELLS[:2], simulated=True), ["torch-nf4"]) == [
        "the run was simulated (x86_64): nothing was computed on any device"
    ]


@pytest.mark.parametrize("text", ["torch-nf4", "a/b/c/d/e", "a//b", ""])
def test_malformed_cell_patterns_are_usage_errors(text: str) -> None:
    with pytest.raises(GateUsageError, match="expected backend/operation"):
        CellPattern.parse(text)


def test_a_folder_must_hold_exactly_one_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert gate.main([str(tmp_path)]) == 2
    assert "expected exactly one run report (*.json), found 0" in capsys.readouterr().err
    write_report(report(*CELLS), tmp_path)
    assert gate.main([str(tmp_path), "--backend", "torch-nf4", "--require", "pass"]) == 0
    write_report(report(*CELLS), tmp_path)  # a second run into the same folder
    assert gate.main([str(tmp_path)]) == 2
    assert "give each job a fresh --qconform-report-dir" in capsys.readouterr().err


def test_cli_exit_codes_and_messages(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write_report(report(*CELLS), tmp_path)
    assert gate.main([str(path), "--backend", "torch-nf4-broken", "--expect-fail", "torch-nf4-broken/dequantize"]) == 0
    assert f"qconform check: {path} (x86_64): 2 fail, 1 pass: ok" in capsys.readouterr().out
    assert gate.main([str(path), "--backend", "torch-nf4-broken", "--require", "PASS"]) == 1
    captured = capsys.readouterr()
    assert "NOT MET" in captured.out and "torch-nf4-broken/dequantize/nf4-b64/fp32: fail" in captured.err
    assert gate.main([str(tmp_path / "nope.json")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    assert gate.main([str(tmp_path / "bad.json")]) == 2
    assert "bad.json: truncated JSON" in capsys.readouterr().err


def test_installed_command_runs(tmp_path: Path) -> None:
    path = write_report(report(*CELLS), tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "pytest_qconform", "check", str(path), "--backend", "torch-nf4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("qconform check: ")
