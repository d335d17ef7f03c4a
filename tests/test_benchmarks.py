"""The benchmark suite: gated out of conformance runs, timed into the report, plotted,
and its report entries read strictly."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pytest_qconform.benchmark import harness as bench
from pytest_qconform.benchmark import plot as benchplot
from pytest_qconform.matrix.cli import merge
from pytest_qconform.report.benchmarks import Benchmark, with_bitsandbytes_ratios
from pytest_qconform.report.cells import Cell
from pytest_qconform.report.records import dump, load
from pytest_qconform.report.run_report import ReportError, RunReport, read_report, write_report
from pytest_qconform.session.plugin import suites_dir

pytest.importorskip("pytest_benchmark")
# Imported before any pytester run: pytester drops modules a run imported, and bitsandbytes
# cannot be imported twice in one process (it registers torch operators).
pytest.importorskip("bitsandbytes.functional")

SUITE = str(suites_dir() / "test_benchmark.py")
# A second NF4 backend that runs as fast as bitsandbytes on the CPU, so a run has a ratio to check.
TWIN_PLUGIN = """
from pytest_qconform.backends.bitsandbytes import BitsandbytesBackend

class TwinBackend(BitsandbytesBackend):
    name = "bnb-twin"

def pytest_qconform_backends(config):
    return {"bnb-twin": TwinBackend}
"""
NF4_128_WEIGHT_BYTES = 128 * 128 // 2 + (128 * 128 // 64) * 4 + 16 * 4  # packed + fp32 absmax + code table


@pytest.fixture(autouse=True)
def _not_an_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``pytest -n``, the inner runs would see this worker's id and pytest-benchmark
    would disable itself (it refuses to time under xdist)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


def run_suite(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest(
        SUITE,
        "--qconform",
        "--qconform-report-dir=out",
        "-p",
        "no:cacheprovider",
        "--qconform-backend=bitsandbytes",
        "-rs",
        *args,
    )


def only_report(pytester: pytest.Pytester) -> RunReport:
    files = sorted((pytester.path / "out").glob("*.json"))
    assert len(files) == 1, files
    return read_report(files[0])


def test_plain_run_skips_every_benchmark_with_the_reason(pytester: pytest.Pytester) -> None:
    result = run_suite(pytester, "--qconform-bench-shapes=small")
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) > 0 and "passed" not in outcomes
    result.stdout.fnmatch_lines(["*benchmark: run with --benchmark-only*"])
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED  # a run that times nothing and checks nothing fails
    result.stdout.fnmatch_lines(["qconform: nothing was checked*record no matrix cell (benchmarks*"])
    report = only_report(pytester)
    assert report.benchmarks == () and report.cells == ()  # skipped benchmarks are no matrix cells
    assert json.loads(Path(report.source).read_text())["schema_version"] == 3


def test_full_shapes_skip_on_the_cpu_and_name_the_option(pytester: pytest.Pytester) -> None:
    result = run_suite(pytester, "--benchmark-only", "-k", "cpu or x86_64 or aarch64 or arm64")
    assert result.ret == 0 and "passed" not in result.parseoutcomes()
    result.stdout.fnmatch_lines(["*benchmark: full-size shapes*too slow on the CPU*--qconform-bench-shapes=small*"])


def test_small_shapes_run_on_the_cpu_into_report_and_extra_info(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(twin_plugin=TWIN_PLUGIN)
    pytester.syspathinsert()
    result = run_suite(
        pytester,
        "--benchmark-only",
        "--qconform-bench-shapes=small",
        "-p",
        "twin_plugin",
        "--qconform-backend=bnb-twin",
        "--benchmark-json=bench.json",
        "-k",
        " and ".join(
            ["128x128", "not dq", *(f"not M{b}" for b in bench.BATCHES if b != 1), "not test_benchmark_quantize"]
        ),
    )
    assert result.parseoutcomes().get("passed") == 4
    result.stdout.fnmatch_lines(["*benchmarks (copy bandwidth*", "*% floor*vs bnb*"])
    report = only_report(pytester)
    assert report.cells == ()  # the conformance tests pytest-benchmark skipped are not recorded
    assert json.loads(Path(report.source).read_text())["schema_version"] == 3
    by_key = {(e.backend, e.operation): e for e in report.benchmarks}
    assert set(by_key) == {(b, op) for b in ("bitsandbytes", "bnb-twin") for op in ("dequantize", "matmul")}
    for entry in report.benchmarks:
        assert entry.shape == (128, 128) and entry.format == "nf4-b64" and entry.dtype == "bf16"
        assert entry.timing == "host-timer" and entry.median_s > 0 and entry.copies >= 2
        assert entry.weight_bytes == NF4_128_WEIGHT_BYTES
        assert entry.output_bytes == (128 * 128 * 2 if entry.operation == "dequantize" else 128 * 2)
        assert entry.activation_bytes == (0 if entry.operation == "dequantize" else 128 * 2)
        assert entry.floor_s == pytest.approx(entry.bytes_moved / entry.copy_bandwidth_bytes_per_s)
        assert entry.percent_of_floor == pytest.approx(100 * entry.floor_s / entry.median_s)
        baseline = by_key[("bitsandbytes", entry.operation)]
        assert entry.time_ratio_to_bitsandbytes == pytest.approx(entry.median_s / baseline.median_s)
    assert by_key[("bitsandbytes", "matmul")].batch == 1 and by_key[("bitsandbytes", "dequantize")].batch is None
    # pytest-benchmark's JSON carries the same numbers; bitsandbytes ran first, so the twin has its ratio.
    saved = json.loads((pytester.path / "bench.json").read_text())["benchmarks"]
    assert len(saved) == 4
    for item in saved:
        info = item["extra_info"]
        assert {"bandwidth_bytes_per_s", "floor_s", "percent_of_floor", "time_ratio_to_bitsandbytes"} <= set(info)
        assert info["time_ratio_to_bitsandbytes"] is not None


# ---------------------------------------------------------------- records, plot, merge


def entry(**overrides) -> Benchmark:
    fields = dict(
        backend="bitsandbytes",
        operation="matmul",
        format="nf4-b64",
        dtype="bf16",
        target="sm90",
        shape=(8192, 8192),
        batch=1,
        median_s=20e-6,
        timing="cuda-events",
        samples=200,
        copies=3,
        rotated_bytes=3 * 35_700_000,
        weight_bytes=35_700_000,
        activation_bytes=16_384,
        output_bytes=16_384,
        copy_bandwidth_bytes_per_s=2.9e12,
        host_median_s=40e-6,
        launch_hidden=True,
    )
    fields.update(overrides)
    return Benchmark(**fields)


def bench_report(*entries: Benchmark) -> RunReport:
    probe = {
        "device_kind": "cuda",
        "arch": "sm90",
        "device_name": "NVIDIA H100",
        "host": "runner-1",
        "torch": "2.13.0",
        "cuda": "12.8",
        "hip": None,
        "simulated": False,
        "backends": {"bitsandbytes": {"available": True, "version": "0.50.2", "reason": ""}},
    }
    return RunReport(probe, (), "2025-01-31T12:00:00Z", benchmarks=with_bitsandbytes_ratios(entries))


def test_ratio_is_time_over_bitsandbytes_for_the_same_case_only() -> None:
    bnb, ours = entry(), entry(backend="triton-nf4", median_s=10e-6)
    other_shape = entry(backend="triton-nf4", shape=(4096, 4096))
    ratios = {
        (e.backend, e.shape): e.time_ratio_to_bitsandbytes for e in with_bitsandbytes_ratios([ours, bnb, other_shape])
    }
    assert ratios == {
        ("triton-nf4", (8192, 8192)): 0.5,
        ("bitsandbytes", (8192, 8192)): 1.0,
        ("triton-nf4", (4096, 4096)): None,
    }
    assert ours.percent_of_floor == pytest.approx(100 * (35_700_000 + 2 * 16_384) / 2.9e12 / 10e-6)


def test_report_with_benchmarks_round_trips(tmp_path: Path) -> None:
    report = bench_report(
        entry(),
        entry(backend="hqq", format="hqq4-b64", launch_hidden=False),
        entry(operation="dequantize", batch=None, activation_bytes=0, output_bytes=134_217_728),
    )
    back = read_report(write_report(report, tmp_path))
    assert back == report and back.benchmarks[1].time_ratio_to_bitsandbytes is None


def test_eager_time_round_trips_and_older_entries_read_without_it(tmp_path: Path) -> None:
    report = bench_report(entry(eager_median_s=41e-6), entry(backend="torch-int4-tinygemm", format="int4-g64"))
    back = read_report(write_report(report, tmp_path))
    assert back == report and back.benchmarks[0].eager_median_s == 41e-6
    older = dump(entry())
    del older["eager_median_s"]  # reports written before issue 27
    assert load(Benchmark, older, "benchmark").eager_median_s is None


def test_copies_exceed_the_cache() -> None:
    assert bench.copies_for(35_700_000, 50 * 2**20) * 35_700_000 >= 2 * 50 * 2**20
    assert bench.copies_for(10, 50 * 2**20) == bench.MAX_COPIES and bench.copies_for(10**12, 1) == bench.MIN_COPIES


def test_slow_calls_are_timed_fewer_times_within_the_measurement_budget() -> None:
    """A fast call keeps every sample; tinygemm's 65 ms call at 8192 rows takes the floor (20
    device samples, not 200: 13 s a case), a middling one what fits ``MEASURE_SECONDS``."""
    assert bench.calls_within(20e-6, bench.GPU_SAMPLES, bench.LEAST_SAMPLES) == bench.GPU_SAMPLES
    assert bench.calls_within(0.065, bench.GPU_SAMPLES, bench.LEAST_SAMPLES) == bench.LEAST_SAMPLES
    assert bench.calls_within(0.01, bench.GPU_SAMPLES, bench.LEAST_SAMPLES, budget_s=1.0) == 100
    assert bench.calls_within(0.0, 7, 2) == 7


def good_entry_dict() -> dict:
    return dump(entry())


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda d: d.pop("median_s"), r"benchmarks\[0\]: missing field 'median_s'"),
        (
            lambda d: d.update(median_s=-1.0),
            r"benchmarks\[0\]\.median_s: Input should be greater than 0, got float -1\.0",
        ),
        (
            lambda d: d.update(median_s="fast"),
            r"benchmarks\[0\]\.median_s: Input should be a valid number, got str 'fast'",
        ),
        (
            lambda d: d.update(operation="gemm"),
            r"benchmarks\[0\]\.operation: Input should be 'dequantize', 'matmul' or 'quantize', got str 'gemm'",
        ),
        (lambda d: d.update(shape=[8192]), r"benchmarks\[0\]\.shape: too few items \(no item 1\)"),
        (lambda d: d.update(batch=None), r"benchmarks\[0\]\.batch: matmul needs the activation rows"),
        (lambda d: d.update(percent_of_floor=99.0), r"benchmarks\[0\]\.percent_of_floor: 99\.0 disagrees"),
        (
            lambda d: d.update(launch_hidden="yes"),
            r"benchmarks\[0\]\.launch_hidden: Input should be a valid boolean, got str 'yes'",
        ),
    ],
)
def test_malformed_benchmark_entry_is_a_clear_error(tmp_path: Path, break_it, message: str) -> None:
    data = bench_report(entry()).to_dict()
    break_it(data["benchmarks"][0])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ReportError, match=message) as info:
        read_report(path)
    assert str(info.value).startswith(str(path))


def test_benchmarks_in_a_version_1_report_are_refused(tmp_path: Path) -> None:
    data = {**bench_report(entry()).to_dict(), "schema_version": 1}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ReportError, match=r"report\.benchmarks: not part of schema_version 1"):
        read_report(path)


def test_benchplot_cli_writes_png_beside_the_report(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    report = bench_report(
        entry(),
        entry(backend="triton-nf4", median_s=12e-6),
        entry(batch=16),
        entry(operation="dequantize", batch=None, activation_bytes=0, output_bytes=134_217_728, median_s=80e-6),
    )
    path = write_report(report, tmp_path)
    assert benchplot.main([str(path)]) == 0
    png = path.with_name(f"{path.stem}-bench.png")
    assert png.read_bytes().startswith(b"\x89PNG") and capsys.readouterr().out.strip() == str(png)
    assert benchplot.main([str(path), "--metric", "time", "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")


def test_benchplot_draws_matmuls_by_rows_a_panel_per_shape(tmp_path: Path, monkeypatch) -> None:
    """The default plot: a matmul's cases are a line per backend against the rows in a panel
    per weight shape (36 cases of 4 series as bars were a 4708-pixel-wide strip), each point
    its ``percent_of_floor``; an operation without rows keeps its bars."""
    pytest.importorskip("matplotlib")
    entries = [
        entry(backend=backend, shape=shape, batch=rows, median_s=20e-6 * rows * shape[0] / 4096)
        for shape in ((4096, 4096), (8192, 8192))
        for rows in (1, 16, 64)
        for backend in ("triton-nf4", "bitsandbytes")
    ]
    dequantize = entry(operation="dequantize", batch=None, activation_bytes=0, output_bytes=134_217_728, median_s=80e-6)
    path = write_report(bench_report(*entries, dequantize), tmp_path)
    import matplotlib.axes

    drawn, bars, original_plot, original_bar = [], [], matplotlib.axes.Axes.plot, matplotlib.axes.Axes.bar

    def spy_plot(self, *args, **kwargs):
        drawn.append((self.get_title(), kwargs.get("label"), list(args[0]), list(args[1])))
        return original_plot(self, *args, **kwargs)

    def spy_bar(self, *args, **kwargs):
        bars.append((self.get_title(), kwargs.get("label")))
        return original_bar(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy_plot)
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", spy_bar)
    assert benchplot.main([str(path)]) == 0
    assert len(drawn) == 4  # two shapes x two backends, a line each
    for title, label, xs, ys in drawn:
        shape = (4096, 4096) if "4096x4096" in title else (8192, 8192)
        backend = label.split(" (")[0]
        expected = [e.percent_of_floor for e in entries if e.shape == shape and e.backend == backend]
        assert xs == [1, 16, 64] and ys == pytest.approx(expected)
    assert {title for title, _, _, _ in drawn} == {"matmul (bf16) 4096x4096", "matmul (bf16) 8192x8192"}
    assert {label for _, label in bars} == {"bitsandbytes (nf4-b64)"}  # the dequantize row: bars


def test_benchplot_draws_the_matmuls_over_the_dense_layer_and_refuses_a_run_without_it(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """``--metric dense``: each backend's matmul time over the dense bf16 peer's of the same
    shape and rows (a panel per shape, a line per backend, the peer itself not drawn);
    ``<stem>-dense.png`` beside the report. A run without the peer is refused, no PNG."""
    pytest.importorskip("matplotlib")
    from pytest_qconform.benchmark.peer import DENSE

    entries = [
        entry(backend=backend, batch=rows, median_s=time_s, eager_median_s=time_s * 1.1)
        for rows in (1, 16, 64)
        for backend, time_s in (("triton-nf4", 20e-6 * rows**0.5), ("bitsandbytes", 40e-6), (DENSE, 38e-6))
    ]
    drawn = []
    path = write_report(bench_report(*entries), tmp_path)
    import matplotlib.axes

    original = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((self.get_title(), kwargs.get("label"), list(args[1]) if len(args) > 1 else None))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    assert benchplot.main([str(path), "--metric", "dense"]) == 0
    png = path.with_name(f"{path.stem}-dense.png")
    assert png.read_bytes().startswith(b"\x89PNG") and capsys.readouterr().out.strip() == str(png)
    device = {label: ys for _, label, ys in drawn if label is not None}
    assert set(device) == {"bitsandbytes (nf4-b64)", "triton-nf4 (nf4-b64)"}  # the peer is the unit, not a line
    assert device["bitsandbytes (nf4-b64)"] == pytest.approx([40 / 38] * 3)
    assert device["triton-nf4 (nf4-b64)"] == pytest.approx([20 / 38, 80 / 38, 160 / 38])
    (tmp_path / "other").mkdir()
    without = write_report(bench_report(*(e for e in entries if e.backend != DENSE)), tmp_path / "other")
    assert benchplot.main([str(without), "--metric", "dense"]) == 2
    assert f"has no {DENSE} matmul entries" in capsys.readouterr().err
    assert not list((tmp_path / "other").glob("*.png"))


@pytest.mark.parametrize("module", ["pytest_qconform", "pytest_qconform.benchmark.plot", "pytest_qconform.matrix.cli"])
def test_every_cli_prints_its_help(module: str) -> None:
    """argparse formats help strings with %: a bare "%" in one crashed ``--help``."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]


def test_benchplot_cli_refuses_bad_reports_in_one_line(tmp_path: Path, capsys) -> None:
    data = bench_report(entry()).to_dict()
    data["benchmarks"][0]["floor_s"] = "soon"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data), encoding="utf-8")
    assert benchplot.main([str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "benchmarks[0].floor_s" in err[0]
    plain = write_report(RunReport(bench_report().probe, (), "2025-01-31T12:00:00Z"), tmp_path)
    assert benchplot.main([str(plain)]) == 2
    assert "has no benchmark entries" in capsys.readouterr().err and not list(tmp_path.glob("*.png"))


def test_matrix_ignores_reports_without_cells_so_they_supersede_nothing() -> None:
    conformance = RunReport(
        bench_report().probe, (Cell("bitsandbytes", "matmul", "nf4-b64", "bf16", "pass"),), "2025-01-31T12:00:00Z"
    )
    later_bench = replace(bench_report(entry()), created="2025-02-01T12:00:00Z")
    timed_nothing = replace(bench_report(), created="2025-02-02T12:00:00Z")  # --benchmark-only, all skipped
    matrix = merge([conformance, later_bench, timed_nothing])
    assert matrix.runs == (conformance,) and matrix.superseded == ()
    assert [row for row in matrix.rows] == [("bitsandbytes", "matmul", "nf4-b64", "bf16")]
