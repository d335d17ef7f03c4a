"""The run report: folding, round trips, atomic writes, strict reading."""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path

import pytest

from pytest_qconform.hardware.probe import BackendStatus, simulated_probe
from pytest_qconform.report import atomic
from pytest_qconform.report.cells import VERDICTS, Cell, fold_cell
from pytest_qconform.report.records import load
from pytest_qconform.report.run_report import SCHEMA_VERSION, ReportError, RunReport, read_report, write_report
from pytest_qconform.report.tables import format_arch_table


def probe_dict(arch: str = "sm90", host: str = "runner-1", **overrides) -> dict:
    probe = {
        "device_kind": "cuda",
        "arch": arch,
        "device_name": "NVIDIA H100",
        "host": host,
        "torch": "2.13.0",
        "cuda": "12.8",
        "hip": None,
        "simulated": False,
        "backends": {
            "bitsandbytes": {"available": True, "version": "0.50.2", "reason": ""},
            "hqq": {"available": False, "version": None, "reason": "hqq: import failed"},
        },
    }
    probe.update(overrides)
    return probe


def cell_dict(**overrides) -> dict:
    cell = {
        "backend": "bitsandbytes",
        "operation": "matmul",
        "format": "nf4-b64-dq",
        "dtype": "bf16",
        "verdict": "pass",
        "cases": 4,
        "worst_error_multiple": 0.31,
        "first_failure": None,
        "reason": "",
    }
    cell.update(overrides)
    return cell


def report_dict(**overrides) -> dict:
    data = {
        "schema": "pytest-qconform/report",
        "schema_version": 1,
        "created": "2025-01-31T12:00:00Z",
        "probe": probe_dict(),
        "cells": [cell_dict()],
    }
    data.update(overrides)
    return data


def write_json(tmp_path: Path, data, name: str = "r.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def cell(
    verdict: str, multiple: float | None = None, cases: int = 1, message: str | None = None, reason: str = ""
) -> Cell:
    failure = {"message": message, "repro": f"pytest -k {message}"} if message else None
    return Cell("hqq", "dequantize", "hqq4-g64", "fp16", verdict, cases, multiple, failure, reason)


# ---------------------------------------------------------------- folding


@pytest.mark.parametrize("worse, better", list(zip(VERDICTS, VERDICTS[1:])))
def test_fold_takes_the_worse_verdict_in_either_order(worse, better):
    assert fold_cell([cell(worse), cell(better)]).verdict == worse
    assert fold_cell([cell(better), cell(worse)]).verdict == worse


def test_fold_precedence_is_the_documented_one():
    assert VERDICTS == ("crashed", "timeout", "fail", "known-failure", "pass", "skipped", "unavailable", "not-claimed")


def test_fold_sums_cases_takes_max_multiple_and_first_failure():
    folded = fold_cell(
        [
            cell("pass", 0.2, 3),
            cell("fail", 5.0, 2, message="first"),
            cell("pass", 0.9, 1),
            cell("fail", 7.0, 1, message="second"),
            cell("skipped", None, 4, reason="no bf16"),
        ]
    )
    assert folded.verdict == "fail"
    assert folded.cases == 11
    assert folded.worst_error_multiple == 7.0
    assert folded.first_failure == {"message": "first", "repro": "pytest -k first"}
    assert folded.key == ("hqq", "dequantize", "hqq4-g64", "fp16")


def test_fold_nan_multiple_is_worst_and_reason_follows_verdict():
    folded = fold_cell(
        [
            cell("known-failure", 0.5, reason="listed: gfx1200"),
            cell("known-failure", math.nan),
            cell("skipped", None, reason="no fp16"),
        ]
    )
    assert math.isnan(folded.worst_error_multiple)
    assert folded.reason == "listed: gfx1200"
    assert fold_cell([cell("pass"), cell("skipped")]).worst_error_multiple is None


def test_a_cells_reason_and_first_failure_do_not_depend_on_the_order_results_arrive():
    """pytest-xdist's workers finish in another order every run (and in another than a serial
    run): the recorder folds a cell's cases in test-id order, so the reason and the first
    failure it reports are those of the cell's first test by id."""
    import types

    from pytest_qconform.session import state
    from pytest_qconform.session.outcomes import Case, one_case_cell
    from pytest_qconform.session.recorder import RunRecorder
    from pytest_qconform.vocabulary import CaseKey, Verdict

    def case(nodeid: str, verdict: str, message: str) -> Case:
        key = CaseKey("hqq", "dequantize", "hqq4-g64", "fp16", "-")
        return Case(nodeid, "-", one_case_cell(key, Verdict(verdict), None, message, f"pytest {nodeid}"))

    cases = [
        case("suites/test_b.py::test_x", "known-failure", "listed: bias cast in place"),
        case("suites/test_a.py::test_y", "known-failure", "listed: state repacked"),
        case("suites/test_c.py::test_z", "fail", "second failure"),
        case("suites/test_a.py::test_w", "fail", "first failure"),
    ]
    folded = []
    for arrival in (cases, cases[::-1], cases[1:] + cases[:1]):
        recorder = types.SimpleNamespace(
            config=types.SimpleNamespace(stash={state.CASES: {c.nodeid: c for c in arrival}})
        )
        folded.append(RunRecorder.cells(recorder))  # type: ignore[arg-type]
    assert folded[0] == folded[1] == folded[2]
    assert folded[0][0].first_failure == {"message": "first failure", "repro": "pytest suites/test_a.py::test_w"}
    known = [c for c in cases if c.verdict == "known-failure"]
    recorder = types.SimpleNamespace(config=types.SimpleNamespace(stash={state.CASES: {c.nodeid: c for c in known}}))
    assert RunRecorder.cells(recorder)[0].reason == "listed: state repacked"  # type: ignore[arg-type]


def test_fold_refuses_mixed_keys_and_empty_input():
    other = Cell("hqq", "matmul", "hqq4-g64", "fp16", "pass")
    with pytest.raises(ValueError, match="group cells by key"):
        fold_cell([cell("pass"), other])
    with pytest.raises(ValueError, match="at least one"):
        fold_cell([])


def test_cell_refuses_unknown_verdict():
    with pytest.raises(ValueError, match="Input should be 'crashed', 'timeout', .* input_value='passed'"):
        Cell("hqq", "matmul", "hqq4-g64", "fp16", "passed")


# ---------------------------------------------------------------- round trip and writing


def sample_report(created: str = "2025-01-31T12:00:00Z", **probe) -> RunReport:
    return RunReport(
        probe_dict(**probe),
        (load(Cell, cell_dict(), "cell"), cell("fail", math.inf, 2, message="x"), cell("pass", math.nan)),
        created,
    )


def test_report_round_trips_through_a_file(tmp_path):
    original = sample_report()
    path = write_report(original, tmp_path)
    assert path.name == "sm90-runner-1-20250131T120000Z.json"
    loaded = read_report(path)
    assert loaded.probe == original.probe and loaded.created == original.created
    assert loaded.cells[:2] == original.cells[:2]
    assert math.isnan(loaded.cells[2].worst_error_multiple)
    assert loaded.source == str(path)
    text = path.read_text(encoding="utf-8")
    assert "NaN" not in text and "Infinity" not in text  # strict JSON for other tools
    assert json.loads(text)["cells"][1]["worst_error_multiple"] == "inf"


def test_a_real_probe_dict_is_accepted(tmp_path):
    probe = simulated_probe("gfx1200").with_backends((BackendStatus("hqq", True, "0.2.8", ""),)).to_dict()
    path = write_report(RunReport(probe, (), "2025-01-31T12:00:00Z"), tmp_path)
    assert read_report(path).probe == probe
    assert path.name == "gfx1200-simulated-20250131T120000Z.json"


def test_filename_is_sanitized_and_never_overwrites(tmp_path):
    report = sample_report(arch="../gfx90a:sramecc+", host=".evil host/\\x")
    first = write_report(report, tmp_path / "new")
    second = write_report(report, tmp_path / "new")
    assert first.parent == second.parent == tmp_path / "new"
    assert first.name == "gfx90a_sramecc-evil_host_x-20250131T120000Z.json"
    assert second.name == "gfx90a_sramecc-evil_host_x-20250131T120000Z-1.json"
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == sorted([first.name, second.name])


def test_write_leaves_no_temp_files(tmp_path):
    write_report(sample_report(), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["sm90-runner-1-20250131T120000Z.json"]


def test_an_error_mid_write_leaves_no_report_and_no_temp(tmp_path, monkeypatch):
    def failing_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        write_report(sample_report(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_error_mid_write_keeps_the_old_file_whole(tmp_path, monkeypatch):
    target = tmp_path / "README.md"
    target.write_text("old\n", encoding="utf-8")
    monkeypatch.setattr(atomic.os, "replace", lambda src, dst: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        atomic.write_text_atomically(target, "new\n")
    assert target.read_text(encoding="utf-8") == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"]


def test_an_atomic_write_gives_a_new_file_the_usual_mode_and_keeps_an_old_ones(tmp_path):
    """nox -s matrix rewrote MATRIX.md and the heatmap with the temp file's 0600: a clean clone's
    files changed mode in git, and other users of a shared checkout lost read access."""
    umask = os.umask(0o022)
    try:
        atomic.write_text_atomically(tmp_path / "new.md", "new\n")
        old = tmp_path / "old.md"
        old.write_text("old\n", encoding="utf-8")
        old.chmod(0o640)
        atomic.write_text_atomically(old, "new\n")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.md").stat().st_mode) == 0o644
    assert stat.S_IMODE(old.stat().st_mode) == 0o640


# ---------------------------------------------------------------- strict reading


def test_not_json_names_file_and_problem(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("this is not json", encoding="utf-8")
    with pytest.raises(ReportError, match=r"bad\.json: not valid JSON") as info:
        read_report(path)
    assert info.value.path == str(path)


def test_truncated_json_is_called_truncated_wherever_it_is_cut(tmp_path):
    text = json.dumps(report_dict(), indent=2)
    path = tmp_path / "cut.json"
    for end in range(1, len(text) - 1):  # mid-string, mid-number, mid-literal, between tokens
        path.write_text(text[:end], encoding="utf-8")
        with pytest.raises(ReportError, match=r"cut\.json: truncated JSON"):
            read_report(path)


def test_empty_and_binary_files_are_reported(tmp_path):
    (tmp_path / "empty.json").write_bytes(b"")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ReportError, match=r"empty\.json: empty file"):
        read_report(tmp_path / "empty.json")
    with pytest.raises(ReportError, match=r"bin\.json: not UTF-8"):
        read_report(tmp_path / "bin.json")


def test_nan_literal_is_rejected(tmp_path):
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(report_dict(cells=[cell_dict(worst_error_multiple=math.nan)])), encoding="utf-8")
    with pytest.raises(ReportError, match=r"nan\.json: NaN is not valid JSON"):
        read_report(path)


@pytest.mark.parametrize(
    "mutate, problem",
    [
        (lambda d: [d], r"top level: expected a JSON object, got list"),
        (
            lambda d: {**d, "schema": "pytest-benchmark"},
            r"schema is 'pytest-benchmark', expected 'pytest-qconform/report'",
        ),
        (
            lambda d: {**d, "schema_version": SCHEMA_VERSION + 1},
            rf"schema_version {SCHEMA_VERSION + 1} is newer than this pytest-qconform reads \(version {SCHEMA_VERSION}\)",
        ),
        (lambda d: {**d, "schema_version": 0}, r"unknown schema_version 0; this pytest-qconform reads version 1"),
        (lambda d: {**d, "schema_version": "1"}, r"schema_version: expected an integer, got str"),
        (lambda d: {k: v for k, v in d.items() if k != "probe"}, r"report: missing field 'probe'"),
        (lambda d: {**d, "created": "yesterday"}, r"created: 'yesterday' is not a UTC ISO 8601 time"),
        (lambda d: {**d, "cells": {}}, r"report.cells: expected a JSON array, got dict"),
        (
            lambda d: {**d, "probe": probe_dict(simulated="no")},
            r"report.probe.simulated: Input should be a valid boolean, got str 'no'",
        ),
        (
            lambda d: {**d, "probe": probe_dict(device_kind="tpu")},
            r"report.probe.device_kind: Input should be 'cpu', 'cuda' or 'rocm', got str 'tpu'",
        ),
        (
            lambda d: {**d, "probe": probe_dict(torch=2.13)},
            r"report.probe.torch: Input should be a valid string, got float 2.13",
        ),
        (
            lambda d: {**d, "probe": {k: v for k, v in probe_dict().items() if k != "arch"}},
            r"probe: missing field 'arch'",
        ),
        (
            lambda d: {**d, "probe": probe_dict(backends={"hqq": {"available": 1, "version": None, "reason": ""}})},
            r"report.probe.backends.hqq.available: Input should be a valid boolean, got int 1",
        ),
        (
            lambda d: {**d, "cells": [cell_dict(), cell_dict(verdict="passed")]},
            r"cells\[1\].verdict: Input should be 'crashed', 'timeout', .* got str 'passed'",
        ),
        (
            lambda d: {**d, "cells": [cell_dict(cases="4")]},
            r"cells\[0\].cases: Input should be a valid integer, got str '4'",
        ),
        (
            lambda d: {**d, "cells": [cell_dict(cases=True)]},
            r"cells\[0\].cases: Input should be a valid integer, got bool True",
        ),
        (
            lambda d: {**d, "cells": [cell_dict(worst_error_multiple="big")]},
            r"cells\[0\].worst_error_multiple: Input should be a valid number, got str 'big'",
        ),
        (
            lambda d: {**d, "cells": [cell_dict(first_failure={"message": "x"})]},
            r"cells\[0\].first_failure: missing field 'repro'",
        ),
        (
            lambda d: {**d, "cells": [{k: v for k, v in cell_dict().items() if k != "dtype"}]},
            r"cells\[0\]: missing field 'dtype'",
        ),
        (  # a key with a default in Python is still one the writer writes (records.EveryKeyWritten)
            lambda d: {**d, "cells": [{k: v for k, v in cell_dict().items() if k != "cases"}]},
            r"report.cells\[0\]: missing field 'cases'",
        ),
        (
            lambda d: {**d, "cells": [cell_dict(backend="")]},
            r"cells\[0\].backend: String should have at least 1 character, got str ''",
        ),
    ],
)
def test_malformed_report_raises_report_error_naming_file_and_problem(tmp_path, mutate, problem):
    path = write_json(tmp_path, mutate(report_dict()), name="runner.json")
    with pytest.raises(ReportError) as info:
        read_report(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert info.value.path == str(path)
    assert re.search(problem, info.value.problem), message


def test_the_unmutated_fixture_is_valid(tmp_path):
    # Guards the parametrized test above: each case fails for its mutation only.
    report = read_report(write_json(tmp_path, report_dict()))
    assert report.cells[0].verdict == "pass"


def test_missing_file_is_a_report_error(tmp_path):
    with pytest.raises(ReportError, match=r"nope\.json: cannot read"):
        read_report(tmp_path / "nope.json")


# ---------------------------------------------------------------- terminal table


def test_arch_table_is_fixed_width_and_sorted():
    report = RunReport(
        probe_dict(), (cell("fail", 12345.0, 2, message="m"), load(Cell, cell_dict(), "cell")), "2025-01-31T12:00:00Z"
    )
    lines = format_arch_table(report).splitlines()
    assert lines[0] == "sm90 (cuda) on runner-1, torch 2.13.0"
    assert lines[1].split() == ["backend", "operation", "format", "dtype", "verdict", "cases", "worst"]
    assert lines[3].split() == ["bitsandbytes", "matmul", "nf4-b64-dq", "bf16", "pass", "4", "0.31"]
    assert lines[4].split() == ["hqq", "dequantize", "hqq4-g64", "fp16", "fail", "2", "1.23e+04"]
    # Columns line up: every verdict starts at the same offset.
    assert lines[3].index("pass") == lines[4].index("fail") == lines[1].index("verdict")


def test_arch_table_marks_simulated_and_empty_runs():
    text = format_arch_table(RunReport(probe_dict(simulated=True), (), "2025-01-31T12:00:00Z"))
    assert "SIMULATED" in text and "no conformance cells recorded" in text


def test_report_dict_is_json_serializable_with_sorted_keys(tmp_path):
    path = write_report(sample_report(), tmp_path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert list(data) == sorted(data)
    assert data["schema"] == "pytest-qconform/report" and data["schema_version"] == 1
    assert os.path.getsize(path) > 0


KILLED_WRITER = r"""
import os, sys, time
from pytest_qconform.report import atomic, run_report as r
def stall(fd):
    print("writing", flush=True)
    time.sleep(60)
atomic.os.fsync = stall
rep = r.RunReport({"device_kind": "cpu", "arch": "x86_64", "device_name": "cpu", "host": "h", "torch": None,
                   "cuda": None, "hip": None, "simulated": False, "backends": {}}, (), "2025-01-31T12:00:00Z")
r.write_report(rep, sys.argv[1])
"""


def test_a_run_killed_mid_write_leaves_no_json_report(tmp_path):
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"  # the report bytes are in the temp file now
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp") and leftovers[0].startswith(".")
    assert list(tmp_path.glob("*.json")) == []  # the matrix scan finds no half-written report
