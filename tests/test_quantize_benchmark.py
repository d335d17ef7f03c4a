"""The quantize benchmark case (``suites/test_benchmark.py::test_benchmark_quantize``): timed
into the report beside bitsandbytes' quantize, with the float weight read and the stored
state written as its bytes. The harness is checked on the CPU's small shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_benchmarks import NF4_128_WEIGHT_BYTES, TWIN_PLUGIN, only_report

# This checkout's suite (the same file as the installed pytest_qconform.suites' after
# ``pip install -e .`` of it; an editable install of another checkout maps elsewhere).
SUITE = Path(__file__).resolve().parents[1] / "suites" / "test_benchmark.py"

pytest.importorskip("pytest_benchmark")
pytest.importorskip("bitsandbytes.functional")


def test_quantize_case_times_into_the_report_with_its_bytes(pytester: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # pytest-benchmark refuses to time under xdist
    pytester.makepyfile(twin_plugin=TWIN_PLUGIN)
    pytester.syspathinsert()
    result = pytester.runpytest(
        str(SUITE),
        "--qconform",
        "--qconform-report-dir=out",
        "-p",
        "no:cacheprovider",
        "--qconform-backend=bitsandbytes",
        "--qconform-backend=bnb-twin",
        "-p",
        "twin_plugin",
        "--benchmark-only",
        "--qconform-bench-shapes=small",
        "-k",
        "test_benchmark_quantize and 128x128",
    )
    assert result.parseoutcomes().get("passed") == 2, result.stdout.str()[-3000:]
    entries = {e.backend: e for e in only_report(pytester).benchmarks}
    assert set(entries) == {"bitsandbytes", "bnb-twin"}
    for entry in entries.values():
        assert entry.operation == "quantize" and entry.batch is None and entry.format == "nf4-b64"
        assert entry.weight_bytes == 128 * 128 * 2  # the bf16 weight read
        assert entry.output_bytes == NF4_128_WEIGHT_BYTES and entry.activation_bytes == 0
    assert entries["bnb-twin"].time_ratio_to_bitsandbytes == pytest.approx(
        entries["bnb-twin"].median_s / entries["bitsandbytes"].median_s
    )
