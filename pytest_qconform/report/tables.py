"""Fixed-width terminal tables of one run: its matrix cells and its benchmarks."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_qconform.report.run_report import RunReport


def format_multiple(multiple: float | None) -> str:
    """A worst error multiple for tables: three significant digits, ``-`` when none."""
    if multiple is None:
        return "-"
    if math.isnan(multiple):
        return "nan"
    if math.isinf(multiple):
        return "inf"
    return f"{multiple:.3g}"


def format_arch_table(report: RunReport) -> str:
    """This run's cells as a fixed-width table for the end of the terminal output."""
    probe = report.probe
    simulated = " [SIMULATED: nothing computed on this device]" if report.simulated else ""
    title = f"{report.arch} ({probe.get('device_kind')}) on {report.host}, torch {probe.get('torch')}{simulated}"
    if not report.cells:
        return f"{title}\n(no conformance cells recorded)"
    header = ("backend", "operation", "format", "dtype", "verdict", "cases", "worst")
    rows = [
        (*c.key, c.verdict, str(c.cases), format_multiple(c.worst_error_multiple))
        for c in sorted(report.cells, key=lambda c: c.key)
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    right = {5, 6}  # numbers align right

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([title, line(header), rule, *(line(row) for row in rows)])


def format_bench_table(report: RunReport) -> str:
    """This run's benchmarks as a fixed-width table: time, bandwidth, % of the copy floor,
    ratio to bitsandbytes."""
    if not report.benchmarks:
        return "(no benchmarks recorded)"
    header = ("backend", "case", "median us", "eager us", "GB/s", "% floor", "vs bnb")
    rows = [
        (
            e.backend,
            e.label,
            f"{e.median_s * 1e6:.1f}",
            f"{e.eager_median_s * 1e6:.1f}" if e.eager_median_s is not None else "-",
            f"{e.bandwidth_bytes_per_s / 1e9:.1f}",
            f"{e.percent_of_floor:.0f}",
            f"{e.time_ratio_to_bitsandbytes:.2f}x" if e.time_ratio_to_bitsandbytes is not None else "-",
        )
        for e in sorted(report.benchmarks, key=lambda e: (e.operation, e.shape, e.batch or 0, e.format, e.backend))
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    copy = report.benchmarks[0].copy_bandwidth_bytes_per_s
    lines = [
        f"benchmarks (copy bandwidth {copy / 1e9:.1f} GB/s; floor = bytes moved / copy bandwidth)",
        "  ".join(h.rjust(w) if i >= 2 else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    lines += [
        "  ".join(v.rjust(w) if i >= 2 else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    ]
    return "\n".join(lines)
