"""Plot a benchmark run: % of the copy floor (or time) per backend, for every case.

CLI: ``python -m pytest_qconform.benchmark.plot REPORT.json [--out PNG] [--metric percent|time]``.
Writes ``<report-stem>-bench.png`` next to the report (``<report-stem>-dense.png`` for the
``dense`` metric) unless ``--out`` says otherwise.
One row of panels per operation. An operation with rows (matmul) has a panel per weight
shape, a line per backend and format against the rows; the others have one panel, cases
(shape, format family) along x, a bar per backend and format. ``percent`` (default) is
``percent_of_floor``: 100 means the backend moved its unavoidable bytes as fast as the
run's device-to-device copy. ``time`` draws the device time and, where the report has it,
the eager per-call time (a loop of calls from Python, nothing queued): dashed beside a
line, a tick over a bar. ``dense``
draws, per matmul shape, each backend's time over the unquantized bf16 layer's
(``peer.DENSE``) against the rows: device time solid, eager time dashed, 1 the dense
layer, so a line below 1 is faster than the layer it replaces and a crossing is where it
stops being (issue 52).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pytest_qconform.benchmark.peer import DENSE
from pytest_qconform.report.benchmarks import Benchmark
from pytest_qconform.report.figures import write_figure_png
from pytest_qconform.report.run_report import ReportError, RunReport, read_report
from pytest_qconform.report.storage import ReportsFolder

METRICS = ("percent", "time", "dense")
PROG = "qconform benchplot"


class BenchPlotError(ValueError):
    """A report that cannot be plotted; the message names it and says what to do."""


def default_png(report_path: str | Path, metric: str = "percent") -> Path:
    path = Path(report_path)
    folder = ReportsFolder(path.parent)
    return folder.bench_dense_plot(path) if metric == "dense" else folder.bench_plot(path)


def _case(entry: Benchmark) -> str:
    batch = f" M={entry.batch}" if entry.batch is not None else ""
    dq = " dq" if entry.format.endswith("-dq") else ""
    return f"{entry.shape[0]}x{entry.shape[1]}{batch}{dq}"


def _case_order(entry: Benchmark) -> tuple:
    return (entry.shape, entry.batch or 0, entry.format.endswith("-dq"))


def _series(entry: Benchmark) -> str:
    return f"{entry.backend} ({entry.format.removesuffix('-dq')})"


# A backend keeps its colour in every panel and every plot (a series is "backend (format)").
BACKEND_COLOURS = {
    "bitsandbytes": "C0",
    "hqq": "C1",
    "torch-int4-tinygemm": "C2",
    "triton-nf4": "C3",
    "hqq-gemlite": "C4",
    "torch-bf16-dense": "C7",
}


def _colour(series: str, index: int) -> str:
    return BACKEND_COLOURS.get(series.split(" (", 1)[0], f"C{4 + index % 6}")


def render(report: RunReport, png_path: str | Path, metric: str = "percent") -> Path:
    """Draw ``report``'s benchmarks into ``png_path`` (Agg canvas, no global backend)."""
    if metric not in METRICS:
        raise BenchPlotError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    where = report.source or "report"
    if not report.benchmarks:
        raise BenchPlotError(
            f"{where}: has no benchmark entries; write one with pytest --qconform --benchmark-only (nox -s bench)"
        )
    if metric == "dense":
        return _render_against_dense(report, png_path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    operations = [
        op for op in ("dequantize", "matmul", "quantize") if any(e.operation == op for e in report.benchmarks)
    ]
    series = sorted({_series(e) for e in report.benchmarks})
    shapes = {
        op: sorted({e.shape for e in report.benchmarks if e.operation == op})
        for op in operations
        if _by_rows(report, op)
    }
    columns = max((len(found) for found in shapes.values()), default=1)
    widest = max(
        (len({_case(e) for e in report.benchmarks if e.operation == op}) for op in operations if op not in shapes),
        default=0,
    )
    fig = Figure(figsize=(max(7.0, 4.2 * columns, 1.0 + 0.32 * widest * len(series)), 3.4 * len(operations)), dpi=100)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(operations), columns)
    copy = report.benchmarks[0].copy_bandwidth_bytes_per_s
    fig.suptitle(f"{_run_title(report)}; copy {copy / 1e9:.0f} GB/s", fontsize=9)
    for row, op in enumerate(operations):
        entries = sorted((e for e in report.benchmarks if e.operation == op), key=_case_order)
        if op in shapes:
            for column, shape in enumerate(shapes[op]):
                ax = fig.add_subplot(grid[row, column])
                ax.set_title(f"{op} ({entries[0].dtype}) {shape[0]}x{shape[1]}", fontsize=9)
                _draw_by_rows(ax, [e for e in entries if e.shape == shape], series, metric, first=column == 0)
            continue
        ax = fig.add_subplot(grid[row, :])
        _draw_bars(ax, entries, series, metric)
        ax.set_title(f"{op} ({entries[0].dtype})", fontsize=9)
    legend_room = 0.0
    if shapes:  # the lines' legend once, below the panels, where it covers no line
        handles = {label: handle for ax in fig.axes for handle, label in zip(*ax.get_legend_handles_labels())}
        fig.legend(
            handles.values(), handles.keys(), loc="lower center", ncol=min(4, len(handles)), fontsize=7, frameon=False
        )
        legend_room = 0.28 / (3.4 * len(operations))
    fig.tight_layout(rect=(0, legend_room, 1, 1))
    return write_figure_png(fig, png_path)


def _by_rows(report: RunReport, op: str) -> bool:
    """Whether ``op``'s cases have a row count each (the matmuls): drawn by rows, a panel per
    shape, where a bar per case was unreadable past a few batches (36 cases x 4 series)."""
    return all(e.batch is not None for e in report.benchmarks if e.operation == op)


def _value(entry: Benchmark, metric: str) -> float:
    return entry.percent_of_floor if metric == "percent" else entry.median_s * 1e6


def _label_axis(ax, metric: str, ylabel: str) -> None:
    if metric == "percent":
        ax.axhline(100.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_ylabel("% of copy floor", fontsize=8)
    else:
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_yscale("log")


def _draw_by_rows(ax, entries: list[Benchmark], series: list[str], metric: str, first: bool) -> None:
    """One line per series against the rows (log 2); with ``time``, the eager time dashed."""
    for index, name in enumerate(series):
        cases = sorted((e for e in entries if _series(e) == name), key=lambda e: e.batch or 0)
        if not cases:
            continue
        colour = _colour(name, index)
        ax.plot([e.batch or 0 for e in cases], [_value(e, metric) for e in cases], marker="o", color=colour, label=name)
        eager = [(e.batch or 0, e.eager_median_s * 1e6) for e in cases if e.eager_median_s is not None]
        if metric == "time" and eager:
            ax.plot(*zip(*eager), linestyle="--", linewidth=0.8, color=colour)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows", fontsize=8)
    ax.tick_params(labelsize=7)
    _label_axis(ax, metric, "us per call: solid device, dashed eager")
    if not first:
        ax.set_ylabel("")


def _draw_bars(ax, entries: list[Benchmark], series: list[str], metric: str) -> None:
    """One bar per series and case; with ``time``, the eager time a tick over its bar."""
    cases = list(dict.fromkeys(_case(e) for e in entries))
    width = 0.8 / len(series)
    for s_index, name in enumerate(series):
        values = {_case(e): _value(e, metric) for e in entries if _series(e) == name}
        xs = [i + (s_index - (len(series) - 1) / 2) * width for i, case in enumerate(cases) if case in values]
        ys = [values[case] for case in cases if case in values]
        if xs:
            bars = ax.bar(xs, ys, width=width, label=name, color=_colour(name, s_index))
        eager = {
            _case(e): e.eager_median_s * 1e6 for e in entries if _series(e) == name and e.eager_median_s is not None
        }
        if metric == "time" and eager and xs:  # eager time: a tick over the bar, in the bar's colour
            ex = [i + (s_index - (len(series) - 1) / 2) * width for i, case in enumerate(cases) if case in eager]
            ax.scatter(
                ex,
                [eager[case] for case in cases if case in eager],
                marker="_",
                s=120,
                linewidths=2,
                color=bars.patches[0].get_facecolor(),
                zorder=3,
            )
    _label_axis(ax, metric, "us per call: bar device, tick eager")
    ax.set_xticks(range(len(cases)), labels=cases, rotation=30, ha="right", fontsize=7)
    ax.legend(fontsize=7, frameon=False)


def _run_title(report: RunReport) -> str:
    return f"{report.arch} ({report.probe.get('device_name')}) on {report.host}, {report.created}"


def _render_against_dense(report: RunReport, png_path: str | Path) -> Path:
    """The ``dense`` metric (module docstring): one panel per matmul shape."""
    where = report.source or "report"
    matmuls = [e for e in report.benchmarks if e.operation == "matmul" and e.batch is not None]
    dense = {(e.shape, e.batch): e for e in matmuls if e.backend == DENSE}
    if not dense:
        raise BenchPlotError(
            f"{where}: has no {DENSE} matmul entries to compare with; they are timed on a GPU beside the backends "
            "(pytest --qconform --benchmark-only)"
        )
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shapes = sorted({shape for shape, _ in dense})
    series = sorted({_series(e) for e in matmuls if e.backend != DENSE})
    fig = Figure(figsize=(4.2 * len(shapes), 3.6), dpi=100)
    FigureCanvasAgg(fig)
    fig.suptitle(f"{_run_title(report)}; matmul time over the dense bf16 layer's", fontsize=9)
    for column, shape in enumerate(shapes):
        ax = fig.add_subplot(1, len(shapes), column + 1)
        for index, name in enumerate(series):
            cases = sorted(
                (e for e in matmuls if _series(e) == name and e.shape == shape and (e.shape, e.batch) in dense),
                key=lambda e: e.batch or 0,
            )
            if not cases:
                continue
            colour = _colour(name, index)
            pairs = [(e, dense[(e.shape, e.batch)]) for e in cases]
            ax.plot(
                [e.batch or 0 for e in cases],
                [e.median_s / peer.median_s for e, peer in pairs],
                marker="o",
                color=colour,
                label=name,
            )
            eager = [
                (e.batch or 0, e.eager_median_s / peer.eager_median_s)
                for e, peer in pairs
                if e.eager_median_s and peer.eager_median_s
            ]
            if eager:
                ax.plot(*zip(*eager), linestyle="--", linewidth=0.8, color=colour)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_title(f"{shape[0]}x{shape[1]}", fontsize=9)
        ax.set_xlabel("rows", fontsize=8)
        if column == 0:
            ax.set_ylabel("time / dense bf16 (solid: device, dashed: eager)", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.axes[0].legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return write_figure_png(fig, png_path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_qconform.benchmark.plot",
        description="Plot the benchmarks of a pytest-qconform run report.",
    )
    parser.add_argument(
        "report", type=Path, metavar="REPORT.json", help="a run report written by pytest --qconform --benchmark-only"
    )
    parser.add_argument("--out", type=Path, help="the PNG to write (default: <report-stem>-bench.png beside it)")
    parser.add_argument(
        "--metric",
        choices=METRICS,
        default="percent",
        help="percent: %% of the copy floor (default); time: median time per call; "
        "dense: matmul time over the dense bf16 layer's, by rows",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 with the PNG's path on stdout; 2 with a one-line error on bad input."""
    args = _parser().parse_args(argv)
    try:
        report = read_report(args.report)
        png = render(report, args.out or default_png(args.report, args.metric), args.metric)
    except (ReportError, BenchPlotError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(
            f"{PROG}: error: cannot draw: {exc}; install matplotlib (pip install 'pytest-qconform[bench]')",
            file=sys.stderr,
        )
        return 2
    except OSError as exc:
        print(f"{PROG}: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
