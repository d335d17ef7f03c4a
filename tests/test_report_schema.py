"""The published report schema: generated, committed as generated, met by every report a run
writes and by the committed ones, and able to fail (``check`` names the first violation)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pytest_qconform.report import gate
from pytest_qconform.report.calls import CallCoverage
from pytest_qconform.report.cells import Cell
from pytest_qconform.report.coverage import Coverage
from pytest_qconform.report.published_schema import SCHEMA_FILE, generate, violation
from pytest_qconform.report.records import dump, load
from pytest_qconform.report.run_report import read_report
from pytest_qconform.report.schema import SchemaError
from pytest_qconform.report.storage import ReportsFolder
from pytest_qconform.vocabulary import Verdict

ROOT = Path(__file__).resolve().parent.parent
DOCS_COPY = ROOT / "docs" / "report.schema.json"
COMMITTED = ReportsFolder(ROOT / "reports")
REGENERATE = "python -m pytest_qconform.report.published_schema docs/report.schema.json"


@pytest.mark.parametrize("copy", [SCHEMA_FILE, DOCS_COPY], ids=["package", "docs"])
def test_the_committed_schema_is_what_the_models_generate(copy: Path) -> None:
    assert copy.read_text(encoding="utf-8") == generate(), f"{copy} is stale: run {REGENERATE}"


def test_the_schema_names_every_record_and_version() -> None:
    schema = json.loads(generate())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert {
        "ReportV1",
        "ReportV2",
        "ReportV3",
        "Cell",
        "FirstFailure",
        "Benchmark",
        "Coverage",
        "Suite",
        "StaleEntry",
        "CallCoverage",
    } <= set(schema["$defs"])
    assert schema["discriminator"]["propertyName"] == "schema_version"
    assert "pass" in schema["$defs"]["Verdict"]["enum"]
    cell = schema["$defs"]["Cell"]
    assert set(cell["required"]) == set(cell["properties"]) - set(Cell.OPTIONAL_KEYS), (
        "every key is written, but the optional ones added after the cell's first version"
    )
    assert Cell.OPTIONAL_KEYS == ("worst_comparative_ratio",)


def test_a_cell_writes_its_comparative_ratio_only_where_one_was_measured() -> None:
    """Contract revision 8's optional key: a cell without a ratio is written as before (old
    reports read back as written), one with a ratio carries it, ``inf`` as the string."""
    bare = Cell("b", "matmul", "nf4-b64", "bf16", Verdict.PASS)
    assert "worst_comparative_ratio" not in dump(bare)
    compared = dataclasses.replace(bare, worst_comparative_ratio=float("inf"))
    assert dump(compared)["worst_comparative_ratio"] == "inf"
    assert load(Cell, dump(compared), "cells[0]").worst_comparative_ratio == float("inf")
    assert violation(json.dumps({**_committed(), "cells": [dump(compared)]})) is None


def test_a_report_a_run_writes_validates(fake_backend_project: pytest.Pytester) -> None:
    """Every record a run writes: cells of every outcome, a first failure, an unavailable
    backend, the suite; the file must meet the schema as written."""
    fake_backend_project.makepyfile(
        test_suite="""
import pytest

@pytest.mark.qconform_operation("dequantize")
def test_passes(qtarget, qbackend):
    pass

@pytest.mark.qconform_operation("matmul")
def test_fails(qtarget, qbackend):
    assert False, "outside its bound"

@pytest.mark.qconform_operation("quantize")
def test_skips(qtarget, qbackend):
    pytest.skip("needs a GPU")
"""
    )
    result = fake_backend_project.runpytest(
        "test_suite.py",
        "--qconform",
        "--qconform-backend=fake",
        "--qconform-backend=missing",
        "--qconform-report-dir=out",
    )
    result.assert_outcomes(passed=1, failed=1, skipped=4)
    (written,) = (fake_backend_project.path / "out").glob("*.json")
    report = json.loads(written.read_text())
    assert {c["verdict"] for c in report["cells"]} == {"pass", "fail", "skipped", "unavailable"}
    assert violation(written.read_text()) is None
    assert gate.main([str(written), "--require", "any"]) == 0


@pytest.mark.parametrize(
    "path",
    [*(p for p in COMMITTED.matrix_inputs() if COMMITTED.sections not in p.parents), *COMMITTED.bench_reports()],
    ids=lambda p: p.relative_to(ROOT / "reports").as_posix(),
)
def test_every_committed_report_validates(path: Path) -> None:
    """reports/ and reports/bench/ (benchmark runs are run reports too); a section
    (reports/sections/) is no run report: it has its own kind and version (sections.py)."""
    assert violation(path.read_text(encoding="utf-8")) is None


@pytest.mark.parametrize(
    "path",
    [*(p for p in COMMITTED.matrix_inputs() if COMMITTED.sections not in p.parents), *COMMITTED.bench_reports()],
    ids=lambda p: p.relative_to(ROOT / "reports").as_posix(),
)
def test_every_committed_report_reads_and_writes_back_as_it_is(path: Path) -> None:
    """The records' readers and writers (pydantic's, records.py, where a record has moved to it)
    keep the file as written: read, then written again, it is the same JSON."""
    assert read_report(path).to_dict() == json.loads(path.read_text(encoding="utf-8"))


def _committed() -> dict:
    return json.loads(next(p for p in COMMITTED.matrix_inputs() if p.parent == COMMITTED.root).read_text())


def _without_verdict(data: dict) -> None:
    del data["cells"][0]["verdict"]


def _cases_as_text(data: dict) -> None:
    data["cells"][0]["cases"] = "4"


def _unknown_verdict(data: dict) -> None:
    data["cells"][0]["verdict"] = "mostly-pass"


def _benchmarks_in_version_1(data: dict) -> None:
    data["schema_version"] = 1
    del data["suite"]
    data["benchmarks"] = []


def _newer_version(data: dict) -> None:
    data["schema_version"] = 4


def _unwritten_cell_key(data: dict) -> None:
    data["cells"][0]["note"] = "hand-edited"


@pytest.mark.parametrize(
    ("break_it", "expected"),
    [
        (_without_verdict, "cells[0]: missing field 'verdict'"),
        (_cases_as_text, "cells[0].cases: Input should be a valid integer, got '4'"),
        (_unknown_verdict, "cells[0].verdict: Input should be 'crashed', "),
        (_benchmarks_in_version_1, "benchmarks: Extra inputs are not permitted"),
        (_newer_version, "top level: Input tag '4' found using 'schema_version' does not match"),
        (_unwritten_cell_key, "cells[0].note: Unexpected keyword argument"),
    ],
)
def test_a_malformed_report_is_named_with_its_first_violation(break_it, expected: str) -> None:
    data = _committed()
    assert violation(json.dumps(data)) is None
    break_it(data)
    found = violation(json.dumps(data))
    assert found is not None and found.startswith(expected)


def test_check_refuses_a_report_that_breaks_the_schema(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A probe key the reader does not rely on, mistyped, is a usage error of the gate (exit 2)."""
    data = _committed()
    data["probe"]["bf16"] = "yes"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    assert gate.main([str(path)]) == 2
    assert f"{path}: report.probe.bf16: Input should be a valid boolean, got str 'yes'" in capsys.readouterr().err


CALLS = {
    "backend": "hqq",
    "operation": "workload:generate",
    "seen": 3,
    "judged": 2,
    "failed": 0,
    "contexts": {"a b": 2},
}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"seen": -1}, "calls[0].seen: Input should be greater than or equal to 0, got int -1"),
        ({"judged": True}, "calls[0].judged: Input should be a valid integer, got bool True"),
        ({"contexts": {"a b": "2"}}, "calls[0].contexts['a b']: Input should be a valid integer, got str '2'"),
        ({"backend": ""}, "calls[0].backend: String should have at least 1 character, got str ''"),
        ({"note": "x"}, "calls[0].note: not a field of this record"),
        ({"failed": None}, "calls[0].failed: Input should be a valid integer, got null"),
    ],
)
def test_a_record_read_by_pydantic_names_the_wrong_field(change: dict, expected: str) -> None:
    assert load(CallCoverage, CALLS, "calls[0]") == CallCoverage("hqq", "workload:generate", 3, 2, 0, {"a b": 2})
    with pytest.raises(SchemaError) as raised:
        load(CallCoverage, {**CALLS, **change}, "calls[0]")
    assert str(raised.value) == expected
    without = {k: v for k, v in CALLS.items() if k != "judged"}
    with pytest.raises(SchemaError, match=r"^calls\[0\]: missing field 'judged'$"):
        load(CallCoverage, without, "calls[0]")
    with pytest.raises(SchemaError, match=r"^calls\[0\]: expected a JSON object, got list$"):
        load(CallCoverage, [], "calls[0]")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"pairs": [["a", "1", "b"]]}, "coverage[0].pairs[0]: too few items (no item 3)"),
        ({"values": {"format": "nf4"}}, "coverage[0].values.format: expected a JSON array, got str"),
        ({"claimed": {"format": [4]}}, "coverage[0].claimed.format[0]: Input should be a valid string, got int 4"),
    ],
)
def test_coverage_read_by_pydantic_names_the_wrong_field_and_derives_unchecked(change: dict, expected: str) -> None:
    """``unchecked`` is written for the file's readers and derived again on reading."""
    coverage = Coverage("hqq", "matmul", 2, {"format": ("hqq4",)}, (("a", "1", "b", "2"),), {"format": ("hqq4", "x")})
    written = dump(coverage)
    assert written["unchecked"] == {"format": ["x"]}
    assert load(Coverage, {**written, "unchecked": {}}, "coverage[0]") == coverage
    with pytest.raises(SchemaError) as raised:
        load(Coverage, {**written, **change}, "coverage[0]")
    assert str(raised.value) == expected
